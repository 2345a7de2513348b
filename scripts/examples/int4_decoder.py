"""Int4 weight-only QAT for your own decoder LM, from training to an onnxruntime model: copy this and change the
three marked places (the model, the text, the recipe).

    python scripts/examples/int4_decoder.py [--text-dir DIR] [--steps 200] [--output decoder_int4.onnx]

It fine-tunes a causal LM with every Linear's weights on the int4 grid (groups of 32 inputs, activations float),
exports it with no KV cache (any batch, any length), converts it to onnxruntime's ``MatMulNBits`` (verified against
the export) and prints the test perplexity of both files.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

from recal_onnx import quantize_qat_export
from recal_torch import ScheduledModifierManager, export_onnx

# (2) the recipe: W4A16 in groups of 32, the LR from 2e-4 down to 2e-5 over the run; lm_head could be ignored
RECIPE = """
- !QuantizationModifier
  start_epoch: 0
  scheme:
    input_activations: null
    weights: {num_bits: 4, symmetric: true, strategy: group, group_size: 32, observer: mse}
- !LearningRateFunctionModifier {start_epoch: 0, end_epoch: 1, lr_func: cosine, init_lr: 2.0e-4, final_lr: 2.0e-5}
"""
SEQ = 128


def build_model() -> nn.Module:
    """(1) your model: e.g. ``AutoModelForCausalLM.from_pretrained(...)``; here a small Llama from a config."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config)


def tokens(folder: Path, limit: int) -> np.ndarray:
    """(3) your text and tokenizer: here the bytes of the ``.py`` files under ``folder``."""
    data = bytearray()
    for path in sorted(folder.rglob("*.py")):
        if len(data) >= limit:
            break
        data += path.read_bytes()[: limit - len(data)]
    return np.frombuffer(bytes(data), np.uint8).astype(np.int64)


class Logits(nn.Module):
    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, use_cache=False).logits


def perplexity(path: Path, windows: np.ndarray) -> float:
    logits = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"ids": windows[:, :-1]})[0]
    loss = F.cross_entropy(torch.from_numpy(logits).flatten(0, 1), torch.from_numpy(windows[:, 1:]).flatten())
    return math.exp(float(loss))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-dir", type=Path, default=Path(sysconfig.get_paths()["stdlib"]) / "json")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output", type=Path, default=Path("decoder_int4.onnx"))
    args = parser.parse_args()
    torch.manual_seed(0)
    data = tokens(args.text_dir, 2_000_000)
    split = int(0.9 * len(data))
    train, test = data[:split], data[split:]
    windows = np.stack([test[i:i + SEQ + 1] for i in range(0, len(test) - SEQ - 1, SEQ + 1)][:32])

    model = build_model()
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = manager.modify(model, torch.optim.AdamW(model.parameters(), lr=2e-4), steps_per_epoch=args.steps)
    model.train()
    rng = np.random.default_rng(0)
    for step in range(args.steps):
        starts = rng.integers(0, len(train) - SEQ - 1, args.batch)
        batch = torch.from_numpy(np.stack([train[s:s + SEQ + 1] for s in starts]))
        optimizer.zero_grad()
        model(input_ids=batch[:, :-1], labels=batch[:, :-1], use_cache=False).loss.backward()
        optimizer.step()
    manager.finalize(model)

    qat = args.output.with_suffix(".qat.onnx")
    export_onnx(Logits(model).eval(), torch.from_numpy(windows[:2, :SEQ]), qat, input_names=["ids"],
                output_names=["logits"], dynamic_sequence=True)
    result = quantize_qat_export(qat, args.output, inputs={"ids": windows[:2, :SEQ]})
    kinds = [n.op_type for n in result.model.graph.node]
    print(f"{kinds.count('MatMulNBits')} MatMulNBits; {qat.stat().st_size / 1e6:.2f} MB -> "
          f"{args.output.stat().st_size / 1e6:.2f} MB; verification: {result.verification}")
    print(f"test perplexity: QAT export {perplexity(qat, windows):.3f}, int4 {perplexity(args.output, windows):.3f}")


if __name__ == "__main__":
    main()
