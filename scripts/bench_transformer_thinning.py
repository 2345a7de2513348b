"""Transformers thinned: attention heads and FFN neurons pruned by a recipe, removed by ``recal_torch.thin``,
then QAT-trained, exported and converted to int8, against the dense model and onnxruntime's quantizers.

Three parts:

- **accuracy** on real data: a ViT (4 layers, hidden 64, 6 heads, FFN 128) trained on the digits (8x8, patches
  of 2). Per seed: the dense model trained ``--epochs``; then, at each setting below, the recipe prunes heads
  and FFN neurons while training on (gradually, then at the final sparsity), ``thin`` removes them, QAT trains
  the thinned model, and the int8 model is run by onnxruntime on the 360 test images. The dense model trained
  for the same total epochs is the reference.
- **latency** on BERT-base- and ViT-B-shaped models (random weights, synthetic inputs): fp32, onnxruntime's
  ``quantize_dynamic`` and ``quantize_static`` of the dense model, recal's int8 of the dense model, and
  recal's int8 of the model thinned at two settings (1/3 of the heads and half the FFN neurons; half the
  heads and 3/4 of the neurons). Batch 1, 1 and 2 threads, median of interleaved rounds; sizes; argmax
  agreement of each int8 model with its own float (QAT) export. BERT's token table is int4 in the thinned
  rows (``scheme_overrides: {Embedding: ...}``).
- **decoder**: :func:`decoder_part`, an int4 decoder pruned and thinned against dense int4 on real text.

    python scripts/bench_transformer_thinning.py [--quick] [--parts accuracy latency] [--json F]

With ``--json`` and one part, the file's other part is kept (run the latency part alone on an idle machine).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F

from recal_core import load_digits
from recal_onnx import quantize_qat_export
from recal_onnx import session
from recal_torch import ScheduledModifierManager, export_onnx, thin

from bench_transformers import Classifier, agreement, bert, feeds, ort_quantized, vit
from bench.timing import interleaved_latency
from bench.results import load, machine, save

SETTINGS = {"1/3 heads, 1/2 FFN": (1 / 3, 0.5), "1/2 heads, 3/4 FFN": (0.5, 0.75)}
HEADS = {"bert": r"['re:.*attention\.self\.(query|key|value)\.weight', 're:.*attention\.output\.dense\.weight']",
         "vit": r"['re:.*attention\.[qkvo]_proj\.weight']"}
FFN = {"bert": r"['re:.*intermediate\.dense\.weight']", "vit": r"['re:.*mlp\.fc1\.weight']"}
INT4_TABLE = ("scheme_overrides: {Embedding: {input_activations: null, weights: {num_bits: 4, group_size: 32}}}")


def pruning(name: str, heads: float, ffn: float, start: int, end: int, total: int) -> str:
    """The recipe: heads and FFN neurons pruned gradually from ``start`` to ``end``, trained on to ``total``."""
    return f"""
- !EpochRangeModifier {{start_epoch: 0, end_epoch: {total}}}
- !GradualKSModifier {{params: {HEADS[name]}, init_sparsity: 0.0, final_sparsity: {heads:.6f},
                      start_epoch: {start}, end_epoch: {end}, update_frequency: 1, mask_type: head}}
- !GradualKSModifier {{params: {FFN[name]}, init_sparsity: 0.0, final_sparsity: {ffn:.6f},
                      start_epoch: {start}, end_epoch: {end}, update_frequency: 1, mask_type: filter}}
"""


def qat_recipe(epochs: int, table: str = "") -> str:
    extra = f", {table}" if table else ""
    return f"""
- !EpochRangeModifier {{start_epoch: 0, end_epoch: {epochs}}}
- !QuantizationModifier {{start_epoch: 0, reduce_range: true{extra}}}
"""


def train(model, recipe: str | None, batches, epochs: int, lr: float, example=None) -> None:
    """``epochs`` passes over ``batches`` (a list of (inputs tuple, labels)) under ``recipe`` (or none)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    manager = None
    if recipe is not None:
        manager = ScheduledModifierManager.from_yaml(recipe)
        optimizer = manager.modify(model, optimizer, steps_per_epoch=len(batches), example_inputs=example)
    model.train()
    for epoch in range(epochs):
        for inputs, labels in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(*inputs), labels).backward()
            optimizer.step()
    if manager is not None:
        manager.finalize(model)
    model.eval()


# --- accuracy: a ViT on the digits ---------------------------------------------------------------------------

def digits_vit():
    import transformers

    config = transformers.ViTConfig(image_size=8, patch_size=2, num_channels=1, hidden_size=64, num_hidden_layers=4,
                                    num_attention_heads=6, intermediate_size=128, num_labels=10,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Classifier(transformers.ViTForImageClassification(config), ("pixel_values",))


def digits_batches(images, labels, size: int, seed: int):
    order = np.random.default_rng(seed).permutation(len(labels))
    x, y = torch.from_numpy(images[:, None]), torch.from_numpy(labels)
    return [((x[order[i:i + size]],), y[order[i:i + size]]) for i in range(0, len(order), size)]


def accuracy(model, images, labels) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(images[:, None])).argmax(1).numpy() == labels).mean())


def onnx_accuracy(path: Path, images, labels) -> float:
    s = session(str(path), 2)
    name = s.get_inputs()[0].name
    got = [np.argmax(s.run(None, {name: images[i:i + 1, None]})[0]) for i in range(len(labels))]
    return float(np.mean(np.array(got) == labels))


def accuracy_part(seeds: list[int], epochs: int, prune_epochs: int, qat_epochs: int, folder: Path) -> dict:
    data = load_digits()
    rows = []
    for seed in seeds:
        t0 = time.perf_counter()
        torch.manual_seed(seed)
        dense_model = digits_vit()
        batches = digits_batches(data.train_images, data.train_labels, 32, seed)
        train(dense_model, None, batches, epochs, 2e-3)
        dense = accuracy(dense_model, data.test_images, data.test_labels)
        longer = digits_vit()
        longer.load_state_dict(dense_model.state_dict())
        train(longer, None, batches, prune_epochs + qat_epochs, 5e-4)
        dense_longer = accuracy(longer, data.test_images, data.test_labels)
        for setting, (heads, ffn) in SETTINGS.items():
            model = digits_vit()
            model.load_state_dict(dense_model.state_dict())
            ramp = max(1, prune_epochs * 2 // 3)
            example = (torch.zeros(1, 1, 8, 8),)
            train(model, pruning("vit", heads, ffn, 0, ramp, prune_epochs), batches, prune_epochs, 5e-4, example)
            masked = accuracy(model, data.test_images, data.test_labels)
            params = sum(p.numel() for p in model.parameters())
            report = thin(model.model)
            thinned_params = sum(p.numel() for p in model.parameters())
            thinned = accuracy(model, data.test_images, data.test_labels)
            train(model, qat_recipe(qat_epochs), batches, qat_epochs, 2e-4)
            stem = f"digits-vit-{seed}-{setting.replace(' ', '').replace('/', '').replace(',', '-')}"
            qat_path, int8_path = folder / f"{stem}.qat.onnx", folder / f"{stem}.int8.onnx"
            export_onnx(model, (torch.from_numpy(data.test_images[:1, None]),), qat_path, dynamo=False,
                        input_names=["pixel_values"])
            quantize_qat_export(qat_path, int8_path)
            int8 = onnx_accuracy(int8_path, data.test_images, data.test_labels)
            rows.append({"seed": seed, "setting": setting, "dense": dense, "dense_longer": dense_longer,
                         "masked": masked, "thinned_fp32": thinned, "int8": int8, "params": params,
                         "thinned_params": thinned_params, "thinned": str(report)})
            print(f"  seed {seed}, {setting}: dense {dense:.4f} (trained on: {dense_longer:.4f}), masked {masked:.4f}, "
                  f"thinned {thinned:.4f}, thinned int8 {int8:.4f}; parameters {params:,} -> {thinned_params:,} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    means = {}
    for setting in SETTINGS:
        mine = [r for r in rows if r["setting"] == setting]
        means[setting] = {k: float(np.mean([r[k] for r in mine]))
                          for k in ("dense", "dense_longer", "masked", "thinned_fp32", "int8")}
        m = means[setting]
        print(f"digits ViT, {setting}, mean of {len(seeds)} seeds: dense {m['dense']:.4f}, dense trained on "
              f"{m['dense_longer']:.4f}, thinned int8 {m['int8']:.4f} "
              f"({100 * (m['int8'] - max(m['dense'], m['dense_longer'])):+.2f} points vs the better dense)")
    return {"epochs": epochs, "prune_epochs": prune_epochs, "qat_epochs": qat_epochs, "rows": rows, "mean": means}


# --- latency: BERT-base- and ViT-B-shaped ---------------------------------------------------------------------

def latency_part(name: str, quick: bool, seq: int, rounds: int, folder: Path) -> dict:
    build = {"bert": bert, "vit": vit}[name]
    torch.manual_seed(0)
    model, batch, names = build(quick, seq)
    one = batch(1, torch.Generator().manual_seed(0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    data = [(batch(2, g), torch.zeros(2, dtype=torch.long)) for _ in range(3)]
    fp32 = folder / f"{name}.fp32.onnx"
    export_onnx(model.eval(), one, fp32, dynamo=False, input_names=names, dynamic_batch=False)
    paths, exports = {"fp32": fp32}, {}
    calibration = [feeds(batch, names, 1, seed) for seed in range(100, 108)]
    for label, (path, _) in ort_quantized(fp32, folder, calibration).items():
        paths[label] = path
    table = INT4_TABLE if name == "bert" else ""
    for label, setting in {"recal int8 dense": None, **{f"recal int8 thinned {k}": v for k, v in SETTINGS.items()}
                           }.items():
        t0 = time.perf_counter()
        torch.manual_seed(0)
        model = build(quick, seq)[0]
        model.load_state_dict(state)
        if setting is not None:
            train(model, pruning(name, *setting, 0, 1, 1), data[:1], 1, 1e-5, one)
            thin(model.model)
        train(model, qat_recipe(1, table if setting is not None else ""), data, 1, 1e-5)
        stem = label.replace(" ", "-").replace("/", "")
        exports[label] = folder / f"{name}.{stem}.qat.onnx"
        export_onnx(model, one, exports[label], dynamo=False, input_names=names, dynamic_batch=False)
        paths[label] = folder / f"{name}.{stem}.int8.onnx"
        quantize_qat_export(exports[label], paths[label])
        print(f"  {name} {label}: pruned, thinned, QAT-trained, exported, converted in "
              f"{time.perf_counter() - t0:.0f}s", flush=True)
    feed = feeds(batch, names, 1, 0)
    latency = {t: interleaved_latency(paths, feed, rounds, per_round=1, threads=t) for t in (1, 2)}
    checks = [feeds(batch, names, 1, seed) for seed in range(200, 216)]
    fp32_size = fp32.stat().st_size
    best_ort = min(latency[1][k] for k in paths if k.startswith("ort"))
    print(f"\n{name}: onnxruntime {ort.__version__}, batch 1, median of {rounds} interleaved rounds")
    print(f"{'model':38s} {'MB':>8s} {'x fp32':>7s} {'t1 ms':>8s} {'t2 ms':>8s} {'vs best ort t1':>14s} {'agree':>6s}")
    rows = []
    for label, path in paths.items():
        size = path.stat().st_size
        agree = agreement(path, exports.get(label, fp32), checks)
        print(f"{label:38s} {size / 1e6:8.2f} {size / fp32_size:7.3f} {latency[1][label]:8.2f} "
              f"{latency[2][label]:8.2f} {best_ort / latency[1][label]:13.2f}x {agree:6.3f}", flush=True)
        rows.append({"label": label, "bytes": size, "ms_1": latency[1][label], "ms_2": latency[2][label],
                     "agree": agree})
    return {"model": name, "seq": seq, "fp32_bytes": fp32_size, "rows": rows}


# per architecture: the four projections of each attention, the FFN's up (and gate) projections
DECODER_HEADS = {"llama": r"['re:.*self_attn\.[qkvo]_proj\.weight']",
                 "gpt-neox": r"['re:.*attention\.query_key_value\.weight', 're:.*attention\.dense\.weight']"}
DECODER_FFN = {"llama": r"['re:.*mlp\.(gate|up)_proj\.weight']", "gpt-neox": r"['re:.*mlp\.dense_h_to_4h\.weight']"}
# label: (heads, FFN neurons pruned, distilled); distilled: the whole loss from the fp32 model trained on
DECODER_SETTINGS = {"1/2 FFN, distilled": (0.0, 0.5, True), "7/12 FFN, distilled": (0.0, 7 / 12, True),
                    "1/4 heads, 1/2 FFN": (0.25, 0.5, False),
                    "1/4 heads, 1/2 FFN, distilled": (0.25, 0.5, True),
                    "1/2 heads, 3/4 FFN, distilled": (0.5, 0.75, True)}
def decoder_key(arch: str) -> str:
    """Where the decoder part's figures for ``arch`` go in the JSON (render_docs reads them there)."""
    return "decoder" if arch == "llama" else f"decoder_{arch}"


DECODER_QAT_LR = 1e-3  # every int4 row's (and the fp32 model trained on's): 2e-4 left the pruned rows unrecovered
DECODER_PRUNE_END = 0.1  # the share of the steps over which heads and neurons are pruned; the rest recovers
DECODER_DISTILL = """
- !DistillationModifier {start_epoch: 0, end_epoch: 1, hardness: 1.0, temperature: 1.0}
"""


def decoder_part(quick: bool, rounds: int, folder: Path, arch: str = "llama",
                 settings: list[str] | None = None) -> dict:
    """A decoder (``arch``: Llama- or GPT-NeoX-shaped) on the standard library's source (``bench_llm.py``'s data,
    model and training; ``settings``: the rows of :data:`DECODER_SETTINGS` to run, all unless given): int4
    dense (onnxruntime's RTN of the fp32 model trained on, recal's QAT) against recal's int4 QAT with heads and FFN
    neurons pruned during the same steps (in whole groups of the int4 scales) and thinned; perplexity, size and
    latency (a 128-token prompt, one token)."""
    import copy
    from types import SimpleNamespace

    import bench_llm as llm

    steps, qat_steps, layers, hidden, mb, windows_n = (60, 30, 2, 128, 1.0, 16) if quick else (800, 300, 4, 256, 8.0, 256)
    args = SimpleNamespace(qat_lr=DECODER_QAT_LR, group=32, batch=16, ternary=None)
    train_data, test_data, files = llm.corpus(int(mb * 1e6), (windows_n + 1) * (llm.SEQ + 1))
    windows = np.stack([test_data[i * (llm.SEQ + 1):(i + 1) * (llm.SEQ + 1)] for i in range(windows_n)])
    torch.manual_seed(0)
    model = llm.build(layers, hidden, arch=arch)
    params = sum(p.numel() for p in model.parameters())
    print(f"  {arch} decoder: {params / 1e6:.2f} M parameters, {steps} fp32 steps, then {qat_steps} for each int4 "
          "row",
          flush=True)
    llm.train(model, train_data, steps, 2e-3, args.batch, seed=0)
    model.eval()
    sample = torch.from_numpy(windows[:2, :llm.SEQ].astype(np.int64))
    more = copy.deepcopy(model)  # the fp32 model trained on for the QAT's steps: what onnxruntime quantizes
    llm.train(more, train_data, qat_steps, args.qat_lr, args.batch, seed=1,
              manager=ScheduledModifierManager.from_yaml(llm.LR_RECIPE.format(lr=args.qat_lr, final_lr=args.qat_lr / 10)))
    baseline = folder / "decoder_fp32.onnx"
    export_onnx(llm.Logits(more.eval()), sample, baseline, input_names=["ids"], output_names=["logits"],
                dynamic_sequence=True)
    llm.drop_exporter_record(baseline)
    rtn = llm.ort_int4(baseline, folder, args.group, [])["ort RTN asymmetric (default)"][0]
    paths = {"fp32 (trained on)": baseline, "ort RTN int4, dense": rtn}
    paths["recal int4 QAT, dense"] = llm.recal_int4(model, train_data, qat_steps, "minmax", args, folder, sample,
                                                    "decoder_dense")[0]
    for label, (heads, ffn, distill) in ((k, DECODER_SETTINGS[k]) for k in settings or DECODER_SETTINGS):
        pruned = copy.deepcopy(model)
        recipe = llm.QAT_RECIPE.format(grouping=f"strategy: group, group_size: {args.group}", observer="minmax",
                                       lr=args.qat_lr, final_lr=args.qat_lr / 10)
        for names, sparsity, mask in ((DECODER_HEADS[arch], heads, "head"), (DECODER_FFN[arch], ffn, "filter")):
            if sparsity:
                recipe += f"""
- !GradualKSModifier {{params: {names}, init_sparsity: 0.0, final_sparsity: {sparsity}, start_epoch: 0,
                      end_epoch: {DECODER_PRUNE_END}, update_frequency: 0.05, mask_type: {mask}}}
"""
        recipe += DECODER_DISTILL if distill else ""
        llm.train(pruned, train_data, qat_steps, args.qat_lr, args.batch, seed=1,
                  manager=ScheduledModifierManager.from_yaml(recipe), teacher=more if distill else None)
        report = thin(pruned.eval())
        print(f"    {label}: {report.removed} heads and neurons thinned", flush=True)
        stem = f"{arch}_{heads:.3f}_{ffn:.3f}{'_kd' if distill else ''}"
        qat = folder / f"{stem}.qat.onnx"
        export_onnx(llm.Logits(pruned), sample, qat, input_names=["ids"], output_names=["logits"],
                    dynamic_sequence=True)
        paths[f"recal int4 QAT, {label} thinned"] = folder / f"{stem}.onnx"
        quantize_qat_export(str(qat), paths[f"recal int4 QAT, {label} thinned"], inputs={"ids": sample.numpy()})
    prompt = {"ids": windows[:1, :llm.SEQ].astype(np.int64)}
    token = {"ids": windows[:1, :1].astype(np.int64)}
    ms_prompt = interleaved_latency(paths, prompt, rounds, per_round=1, threads=1)
    ms_token = interleaved_latency(paths, token, rounds, per_round=3, threads=1, min_seconds=0.05)
    rows = [{"label": label, "ppl": llm.perplexity(path, windows), "bytes": path.stat().st_size,
             "ms_prompt": ms_prompt[label], "ms_token": ms_token[label]} for label, path in paths.items()]
    for r in rows:
        print(f"  {r['label']:44s} ppl {r['ppl']:.4f}  {r['bytes'] / 1e6:6.2f} MB  prompt {r['ms_prompt']:7.2f} ms  "
              f"token {r['ms_token']:6.3f} ms", flush=True)
    return {**machine(), "params": params, "layers": layers, "hidden": hidden, "steps": steps, "qat_steps": qat_steps,
            "settings": list(settings or DECODER_SETTINGS), "qat_lr": args.qat_lr, "prune_end": DECODER_PRUNE_END,
            "distill": DECODER_DISTILL.strip(), "group": args.group, "test_tokens": int(windows[:, 1:].size),
            "files": files, "rounds": rounds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small models, 1 seed, few epochs (a smoke test)")
    parser.add_argument("--parts", nargs="+", default=["accuracy", "latency", "decoder"],
                        choices=["accuracy", "latency", "decoder"])
    parser.add_argument("--models", nargs="+", default=["bert", "vit"], choices=["bert", "vit"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--arch", choices=sorted(DECODER_HEADS), default="llama",
                        help="the decoder part's model (its figures go under decoder, or decoder_<arch>)")
    parser.add_argument("--settings", nargs="+", choices=sorted(DECODER_SETTINGS),
                        help="the decoder part's pruned rows (all unless given)")
    parser.add_argument("--json", type=Path, help="also write the results here (docs/results/thinning_transformers.json)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="recal-bench-thinning-"))
    warnings.filterwarnings("ignore")
    out = {**machine(), "quick": args.quick, "rounds": args.rounds}
    if "accuracy" in args.parts:
        seeds, epochs = (args.seeds[:1], 2) if args.quick else (args.seeds, args.epochs)
        out["accuracy"] = accuracy_part(seeds, epochs, max(2, epochs // 2), max(1, epochs // 8), folder)
    if "latency" in args.parts:
        out["latency"] = [latency_part(m, args.quick, args.seq, 3 if args.quick else args.rounds, folder)
                          for m in args.models]
    key = decoder_key(args.arch)
    if "decoder" in args.parts:
        out[key] = decoder_part(args.quick, 3 if args.quick else args.rounds, folder, args.arch, args.settings)
    if args.json:
        if args.json.exists():  # one part run again: the other parts' figures stay, with the labels they had
            old = load(args.json)
            if {"accuracy", "latency"} & set(args.parts):
                out = {**{k: v for k, v in old.items() if k.startswith(("accuracy", "latency", "decoder"))}, **out}
            else:
                out = {**old, key: out[key]}
        save(args.json, out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
