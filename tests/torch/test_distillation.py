"""DistillationModifier in PyTorch: a teacher passed to modify(), the blended loss from manager.loss()."""

import math

import pytest
import torch
from torch import nn

from recal_core import RecipeError
from recal_torch import ScheduledModifierManager

from tests.support.torch_models import SmallCNN, batches

RECIPE = """
- !EpochRangeModifier {start_epoch: 0, end_epoch: 3}
- !DistillationModifier {start_epoch: 1, end_epoch: 2, hardness: 0.7, temperature: 2.0}
"""
SPE = 2


def _reference_kd(student, teacher, temperature):
    """T^2 * mean over rows of KL(softmax(t/T) || softmax(s/T)), written out."""
    student, teacher = student.detach(), teacher.detach()
    total = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist()):
        zs = [v / temperature for v in s_row]
        zt = [v / temperature for v in t_row]
        ls = [v - math.log(sum(math.exp(x) for x in zs)) for v in zs]
        lt = [v - math.log(sum(math.exp(x) for x in zt)) for v in zt]
        total += sum(math.exp(b) * (b - a) for a, b in zip(ls, lt))
    return temperature ** 2 * total / len(student)


def test_the_loss_is_blended_only_while_the_modifier_is_in_force():
    torch.manual_seed(0)
    student, teacher = SmallCNN(), SmallCNN()
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = manager.modify(student, torch.optim.SGD(student.parameters(), lr=0.05), steps_per_epoch=SPE,
                               teacher=teacher)
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    for k, (x, y) in enumerate(batches(3 * SPE)):
        optimizer.zero_grad()
        outputs = student(x)
        plain = nn.functional.cross_entropy(outputs, y)
        loss = manager.loss(plain, x, outputs)
        if SPE <= k < 2 * SPE:
            with torch.no_grad():
                kd = _reference_kd(outputs, teacher(x), 2.0)
            assert loss.item() == pytest.approx(0.7 * kd + 0.3 * plain.item(), rel=1e-5), k
        else:
            assert loss is plain, k
        loss.backward()
        optimizer.step()


class _QA(nn.Module):
    """A model returning named outputs, as Hugging Face models do (ModelOutput is a dict)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 8)

    def forward(self, features):
        h = self.body(features)
        return {"start_logits": h[:, :4], "end_logits": h[:, 4:], "hidden": h}


def test_named_outputs_and_keys():
    torch.manual_seed(1)
    recipe = ("- !DistillationModifier {hardness: 1.0, temperature: 5.5, distill_output_keys: [start_logits, end_logits]}\n"
              "- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}")
    student, teacher = _QA(), _QA()
    manager = ScheduledModifierManager.from_yaml(recipe)
    manager.modify(student, torch.optim.SGD(student.parameters(), lr=0.1), steps_per_epoch=1, teacher=teacher)
    inputs = {"features": torch.randn(5, 6)}
    out = student(**inputs)
    loss = manager.loss(torch.tensor(3.0), inputs, out)
    with torch.no_grad():
        t = teacher(**inputs)
    expected = (_reference_kd(out["start_logits"], t["start_logits"], 5.5)
                + _reference_kd(out["end_logits"], t["end_logits"], 5.5)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_mismatches_are_clear_errors():
    model = SmallCNN()
    with pytest.raises(RecipeError, match=r"<string>:3:3: !DistillationModifier .*needs a teacher model; expected "
                                          r"manager.modify\(..., teacher=teacher_model\)"):
        ScheduledModifierManager.from_yaml(RECIPE).modify(model, torch.optim.SGD(model.parameters(), lr=0.1), SPE)
    recipe = "- !DistillationModifier {distill_output_keys: [logits]}\n- !EpochRangeModifier {start_epoch: 0, end_epoch: 1}"
    student = _QA()
    manager = ScheduledModifierManager.from_yaml(recipe)
    manager.modify(student, torch.optim.SGD(student.parameters(), lr=0.1), steps_per_epoch=1, teacher=_QA())
    inputs = {"features": torch.randn(2, 6)}
    with pytest.raises(ValueError, match="student's outputs have no tensor 'logits'.*start_logits, end_logits, hidden"):
        manager.loss(torch.tensor(1.0), inputs, student(**inputs))

    class Wide(_QA):
        def forward(self, features):
            return {**super().forward(features), "start_logits": torch.zeros(len(features), 9)}

    manager = ScheduledModifierManager.from_yaml(recipe.replace("[logits]", "[start_logits]"))
    student = _QA()
    manager.modify(student, torch.optim.SGD(student.parameters(), lr=0.1), steps_per_epoch=1, teacher=Wide())
    with pytest.raises(ValueError, match=r"teacher's output 'start_logits' is shape \(2, 9\), the student's has shape \(2, 4\)"):
        manager.loss(torch.tensor(1.0), inputs, student(**inputs))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_teacher_that_outputs_nan_or_infinity_is_an_error_before_the_student_is_touched(poison):
    """A teacher whose outputs hold NaN or infinity (a float16 teacher past its range, a broken checkpoint): the
    step's loss is refused naming the output, before the KD term makes the student's weights NaN."""
    torch.manual_seed(0)
    student, teacher = SmallCNN(), SmallCNN()
    with torch.no_grad():
        teacher.fc.bias[3] = poison  # every row's logit 3
    manager = ScheduledModifierManager.from_yaml(RECIPE)
    optimizer = manager.modify(student, torch.optim.SGD(student.parameters(), lr=0.05), steps_per_epoch=SPE,
                               teacher=teacher)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    for k, (x, y) in enumerate(batches(2 * SPE)):
        optimizer.zero_grad()
        outputs = student(x)
        plain = nn.functional.cross_entropy(outputs, y)
        if k < SPE:  # before the modifier: the teacher is not run
            loss = manager.loss(plain, x, outputs)
        else:
            with pytest.raises(ValueError, match=r"the teacher's output 'output' holds NaN or infinity \((\d+) of "
                                                 r"\1 rows of this batch\)"):
                manager.loss(plain, x, outputs)
            break
        loss.backward()
        optimizer.step()
    assert all(torch.isfinite(v).all() for v in student.state_dict().values() if v.is_floating_point())
    assert before.keys() == student.state_dict().keys()
