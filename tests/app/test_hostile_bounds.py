"""Hostile files and faults: no unbounded time or memory from a small file (alias bombs, costly eval, catastrophic
patterns, huge epochs, a ten-thousand-node chain). Each test here failed before its fix."""

import time
from unittest import mock

import numpy as np
import pytest

from recal_core import RecipeError, load_recipe
from recal_core.expressions import ExpressionBudget
from recal_onnx import quantize_qat_export
from tests.app.hostile_inputs import _RANGE, _cli, _loads_quickly, _one_line
from tests.support.hang_guard import HANG_SECONDS
from tests.support.paths import ROOT


def test_alias_bombs_recursion_and_deep_nesting_are_located_and_fast():
    levels = ["a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb = "\n".join(levels) + "\nmodifiers: []\n"  # 10**9 leaves in 1 KB
    assert "expands to more than 200,000 values" in _loads_quickly(bomb)
    assert "<string>:1:4: a value contains itself" in _loads_quickly("a: &a [1, *a]\nmodifiers: []")
    assert "nesting deeper than 64 levels" in _loads_quickly("x: " + "[" * 5000 + "]" * 5000)
    assert _loads_quickly("x: " + "[" * 5000 + "]" * 5000).startswith("<string>:1:")


@pytest.mark.parametrize("expr, words", [
    ("((((10**64)**64)**64)**64)**64", "beyond recal's limit of 2**63"),
    ("'x' * 10**10", "more than 10,000 items"),
    ("9**9**9", "exponent"),
    ("1e300 * 1e300", "not a finite number"),
])
def test_eval_cannot_build_huge_values(expr, words):
    text = f"n: eval({expr})\nmodifiers:\n- !EpochRangeModifier {{start_epoch: 0, end_epoch: 3}}\n"
    assert words in _loads_quickly(text)


def test_a_catastrophic_regex_is_cut_off_with_its_location():
    from recal_core.params import ParamInfo, resolve_params

    recipe = load_recipe("- !ConstantKSModifier {params: ['re:(a|aa)+$']}")
    params = [ParamInfo("a" * 60 + "b", "a" * 60, True)]
    started = time.perf_counter()
    with pytest.raises(RecipeError, match=r"<string>:1:\d+: .*field 'params': pattern 're:\(a\|aa\)\+\$' ran out of the recipe's 1 s"):
        resolve_params(recipe, 0, params, pruning=True)
    assert time.perf_counter() - started < HANG_SECONDS  # the 1 s budget's own words say it ran out


@pytest.mark.parametrize("expr, words", [
    ("'%03000000000d' % 0", "a %-format width or precision of 3,000,000,000"),
    ("'%.3000000000f' % 1.5", "a %-format width or precision of 3,000,000,000"),
    ("'%*d' % (5, 1)", "a '*' width or precision"),
    ("+".join(["1"] * 150_000), "the expression is 299,999 characters long; expected at most 10,000"),
    ("+".join(["1"] * 4_000), "nested more than 100 operations deep"),
    ("-" * 9_000 + "1", "nested more than 100 operations deep"),
])
def test_eval_refuses_costly_operations_before_doing_them(expr, words):
    message = _loads_quickly(f"n: eval({expr}){_RANGE}", peak_bytes=64 << 20)  # a 3 GB string would show
    assert words in message and "recursive alias" not in message
    assert len(message) < 400, message  # the expression is shown shortened


def test_eval_work_is_one_budget_per_recipe_and_variables_resolve_in_linear_time():
    heavy = "".join(f"v{i}: eval('x' * 9999 + 'y')\n" for i in range(600))
    message = _loads_quickly(heavy + _RANGE)
    assert message.count("5,000,000 operations") == 1, message[:500]  # said once, where the budget ran out
    chain = "".join(f"v{i}: eval(v{i + 1} + 1)\n" for i in range(2_000)) + "v2000: 1\n"
    spent = []
    spend = ExpressionBudget.spend
    with mock.patch.object(ExpressionBudget, "spend", lambda self, units, source: (spent.append(units),
                                                                                  spend(self, units, source))[1]):
        recipe = load_recipe(chain + "modifiers:\n- !EpochRangeModifier {start_epoch: 0, end_epoch: eval(v0 - 1999)}\n")
    # each variable evaluated once: a few units a link, where resolving each from scratch would take millions
    assert recipe.max_epochs == 2 and sum(spent) < 10 * 2_000, sum(spent)


def test_patterns_are_bounded_at_load_and_timed_once_per_recipe():
    from recal_core.model_plan import plan_model
    from recal_core.params import ParamInfo

    for pattern in ("(?:a{1000}){1000}", "((?:a{100}){100}){100}", "a" * 1_001):
        message = _loads_quickly(f"- !ConstantKSModifier {{start_epoch: 0, end_epoch: 3, params: ['re:{pattern}']}}",
)
        assert "field 'params'" in message and ("unroll to" in message or "1,001 characters" in message), message
    slow = "p: &p ['re:(a|aa)+$']\nmodifiers:\n" + "- !ConstantKSModifier {start_epoch: 0, end_epoch: 3, params: *p}\n" * 20
    distinct = "modifiers:\n" + "".join(
        f"- !ConstantKSModifier {{start_epoch: 0, end_epoch: 3, params: ['re:(a|aa)+{i}$']}}\n" for i in range(20))
    params = [ParamInfo("a" * 60 + "b", "a" * 60, True)]
    for text in (slow, distinct):
        started = time.perf_counter()
        with pytest.raises(RecipeError, match="ran out of the recipe's 1 s"):
            plan_model(load_recipe(text).bind(10), params, {params[0].name: 10})
        # one 1 s budget for the recipe, not one per pattern (20 s): the margin is for a loaded 2-core machine
        assert time.perf_counter() - started < 5.0  # the budget is wall-clock, so load adds little


def test_what_a_recipe_expands_to_is_bounded():
    text = ("v: eval('re:' + 'x' * 990)\np: &p [" + ", ".join(["eval(v)"] * 3000) + "]\nmodifiers:\n"
            + "- !ConstantKSModifier {start_epoch: 0, end_epoch: 3, params: *p}\n" * 10)
    message = _loads_quickly(text, peak_bytes=12 << 20)  # expanded, the values would hold 30 M characters
    assert "exceed 2,000,000 characters" in message and message.count("exceed") == 1


def test_check_and_tf_tables_grow_with_the_recipe_not_its_epochs(tmp_path):
    recipe = tmp_path / "many.yaml"
    recipe.write_text("modifiers:\n" + "".join(
        f"- !GradualKSModifier {{start_epoch: 0, end_epoch: 100000, update_frequency: 1000, init_sparsity: 0.05, "
        f"final_sparsity: 0.8, params: [p{i}]}}\n" for i in range(400)))
    started = time.perf_counter()
    result = _cli("check", str(recipe))
    assert result.returncode == 0, result.stderr[-2000:]
    assert time.perf_counter() - started < HANG_SECONDS  # the table itself is milliseconds
    assert "201 of 100001 epochs shown" in result.stdout and len(result.stdout.splitlines()) < 700
    from recal_keras.recipe_support import check_table_size

    with pytest.raises(ValueError, match="800 per-step tables; recal_tf tabulates .* at most 10,000,000 steps and "
                                         "20,000,000 entries"):
        check_table_size(load_recipe(recipe).bind(1), "recal_tf")


def test_huge_epochs_and_huge_files_are_refused_before_they_cost(tmp_path):
    assert "less than or equal to 100000" in _loads_quickly("- !EpochRangeModifier {start_epoch: 0, end_epoch: 1e12}")
    big = tmp_path / "big.yaml"
    big.write_text("x: [" + "1, " * 1_000_000 + "1]\nmodifiers: []\n")
    started = time.perf_counter()
    with pytest.raises(RecipeError, match="big.yaml: the recipe file is .* bytes; expected a recipe of at most"):
        load_recipe(big)
    assert time.perf_counter() - started < 5  # a stat; parsing the file would take tens of seconds
    line = _one_line(_cli("check", str(ROOT / "recal_core/recipes/prune.yaml"), "--steps-per-epoch", "100000000000"))
    assert "at most 1,000,000,000 steps per epoch" in line


def test_check_plots_a_long_schedule_with_bounded_points(tmp_path):
    from recal_app.report import MAX_PLOT_POINTS, sample_steps

    schedule = load_recipe("- !EpochRangeModifier {start_epoch: 0, end_epoch: 100000}").bind(100_000)
    assert len(sample_steps(schedule)) <= 4 * MAX_PLOT_POINTS + 1


def test_a_ten_thousand_node_elementwise_chain_converts_in_bounded_time():
    """A hostile 10,000-node chain of elementwise ops between a DQ and a Q: one table, in linear time (the island's
    ordering searched the nodes left at every step: 176 s; now 6.6 s on this project's machine)."""

    from tests.support.onnx_graphs import Builder

    b = Builder()
    y = b.qdq("x", 0.03, 128)
    for _ in range(10_000):
        y = b.node("Add", [y, b.const(np.float32(1e-4))])
    model = b.model([("x", [1, 16])], [b.qdq(y, 0.05, 128)])
    started = time.perf_counter()
    result = quantize_qat_export(model)
    assert time.perf_counter() - started < 4 * HANG_SECONDS  # 4 s on a quiet machine; quadratic work would take hours
    assert [n.op_type for n in result.model.graph.node].count("Gather") == 1 and result.verification.max_steps == 0
