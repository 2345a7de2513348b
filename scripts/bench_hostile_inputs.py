"""Hostile recipe inputs: each case loaded (or `recal check`ed) in a fresh process under a 4 GB address-space cap;
its time, peak memory and the first line of what recal said, as a table.

The cases are the unbounded-cost recipes of the reliability issue (string formatting, regex compile, repeated
slow patterns, chained variables, long expressions, hundreds of modifiers over 100,000 epochs, an alias-expanded
recipe). The goal for each: a clear one-line error or a correct result, under 2 s and 500 MB.

    python scripts/bench_hostile_inputs.py
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

RANGE = "modifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}\n"
CASES = {
    "eval('%03000000000d' % 0)": "n: eval('%03000000000d' % 0)\n" + RANGE,
    "150,000-term eval sum": "n: eval(" + "+".join(["1"] * 150_000) + ")\n" + RANGE,
    "600 variables of 10,000 chars": "".join(f"v{i}: eval('x' * 9999 + 'y')\n" for i in range(600)) + RANGE,
    "1,000 chained eval variables": "v0: 1\n" + "".join(f"v{i}: eval(v{i - 1} + 1)\n" for i in range(1, 1000)) + RANGE,
    "re:(?:a{1000}){1000}": "modifiers:\n- !ConstantKSModifier {start_epoch: 0, end_epoch: 3, "
                            "params: ['re:(?:a{1000}){1000}']}\n",
    "3,000 aliased eval(v) x 10 modifiers": "v: eval('re:' + 'x' * 990)\np: &p [" + ", ".join(["eval(v)"] * 3000)
                                            + "]\nmodifiers:\n" + "- !ConstantKSModifier {start_epoch: 0, "
                                            "end_epoch: 3, params: *p}\n" * 10,
}
CHECK = ("recal check: 400 GradualKS x 100,000 epochs", "modifiers:\n" + "".join(
    f"- !GradualKSModifier {{start_epoch: 0, end_epoch: 100000, update_frequency: 1000, init_sparsity: 0.05, "
    f"final_sparsity: 0.8, params: [p{i}]}}\n" for i in range(400)))
PATTERNS = ("20 aliases of re:(a|aa)+$ against a model", "p: &p ['re:(a|aa)+$']\nmodifiers:\n"
            + "- !ConstantKSModifier {start_epoch: 0, end_epoch: 3, params: *p}\n" * 20)

LOAD = """
import resource, sys, time
from recal_core import RecipeError, load_recipe
started = time.perf_counter()
try:
    recipe = load_recipe(sys.argv[1])
    said = "loaded"
    if len(sys.argv) > 2:  # match the patterns against a model's names
        from recal_core.model_plan import plan_model
        from recal_core.params import ParamInfo
        params = [ParamInfo("a" * 60 + "b", "a" * 60, True)]
        plan_model(recipe.bind(10), params, {params[0].name: 10})
except RecipeError as exc:
    said = str(exc).splitlines()[0]
print(f"{time.perf_counter() - started:.2f}\\t{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}\\t{said}")
"""


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def run(command: list[str]) -> tuple[str, str, str]:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, preexec_fn=_limit)
    except subprocess.TimeoutExpired:
        return "> 120", "?", "timed out"
    if out.returncode not in (0, 2) or not out.stdout.strip():
        return "?", "?", (out.stderr.strip().splitlines() or ["crashed"])[-1][:100]
    seconds, mb, said = out.stdout.strip().splitlines()[-1].split("\t", 2)
    return seconds, mb, said[:110]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in [*CASES.items(), PATTERNS]:
            path = Path(tmp) / "recipe.yaml"
            path.write_text(text)
            extra = ["match"] if (name, text) == PATTERNS else []
            rows.append((name, *run([sys.executable, "-c", LOAD, str(path), *extra])))
        path = Path(tmp) / "many.yaml"
        path.write_text(CHECK[1])
        timed = textwrap.dedent("""
            import resource, subprocess, sys, time
            started = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "recal_app.cli", "check", sys.argv[1]], capture_output=True,
                                 text=True)
            lines = out.stdout.splitlines()
            said = next((l for l in lines if "epochs shown" in l), (out.stderr.strip().splitlines() or ["?"])[-1])
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            print(f"{time.perf_counter() - started:.2f}\\t{peak:.0f}\\t{len(lines)} lines; {said}")
        """)
        rows.append((CHECK[0], *run([sys.executable, "-c", timed, str(path)])))
    print("| case | seconds | peak MiB | what recal said |\n|---|---|---|---|")
    for name, seconds, mb, said in rows:
        print(f"| {name} | {seconds} | {mb} | {said.replace('|', '/')} |")


if __name__ == "__main__":
    main()
