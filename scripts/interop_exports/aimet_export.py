"""AIMET's documented QAT flow at its defaults, into tests/fixtures/interop/aimet-small-resnet.onnx; the same with
4-bit weights (``default_param_bw=4``, W4A8: a QuantizeLinear of each float weight to int4, its BatchNorms apart)
into aimet-w4a8-small-resnet.onnx, and with 16-bit activations (``default_output_bw=16``, A16W8, Qualcomm's NPU
form) into refused/aimet-a16w8-small-resnet.onnx (no integer kernel reads a 16-bit activation: refused by name).

The float SmallResNet (``common.py``) is trained a few steps, wrapped in ``QuantizationSimModel`` (8-bit weights and
activations, AIMET's default config, ``training_range_learning_with_tf_init``: QAT that learns its ranges from
calibrated starts), calibrated by ``compute_encodings``, QAT-trained a few steps and exported by
``aimet_torch.onnx.export`` (QuantizeLinear / DequantizeLinear, int32 biases, opset 21, TorchScript path as its
documentation shows; batch fixed at 1). aimet-torch asks for torchvision, whose registry build is for another torch;
this script stands in the few names aimet imports at load. Run in a venv with ``torch==2.13.0`` installed first,
then aimet-torch without its dependencies and those it needs:

    python -m venv /tmp/venv_aimet && /tmp/venv_aimet/bin/pip install torch==2.13.0 && \\
        /tmp/venv_aimet/bin/pip install --no-deps aimet-torch && /tmp/venv_aimet/bin/pip install Jinja2 PyYAML \\
        jsonschema networkx numpy onnx onnx_ir onnxscript pandas psutil safetensors scipy tqdm scikit-learn \\
        matplotlib tensorboard "bokeh<=3.6.3" holoviews hvplot cvxpy osqp
    /tmp/venv_aimet/bin/python scripts/interop_exports/aimet_export.py
"""

import warnings

import torch

from common import FIXTURES, SIZE, SmallResNet, calibration, export_aimet_classic, stand_in_torchvision, trained

stand_in_torchvision()

import aimet_torch.onnx  # noqa: E402
from aimet_torch.common.defs import QuantScheme  # noqa: E402
from aimet_torch.quantsim import QuantizationSimModel  # noqa: E402


def export(path, activation_bits: int = 8, weight_bits: int = 8, classic: bool = False) -> None:
    torch.manual_seed(0)
    model = trained(SmallResNet())
    example = torch.randn(1, 3, SIZE, SIZE)
    sim = QuantizationSimModel(model, example, quant_scheme=QuantScheme.training_range_learning_with_tf_init,
                               default_output_bw=activation_bits, default_param_bw=weight_bits)
    sim.compute_encodings(lambda m: [m(x) for x in calibration()])
    trained(sim.model, steps=10, seed=1)  # QAT, ranges learned
    path.parent.mkdir(parents=True, exist_ok=True)
    if classic:  # sim.export: the float model and its encodings, then the check of recal's reading against the sim
        export_aimet_classic(sim, example, path, calibration(batches=32, batch=1, seed=7))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        aimet_torch.onnx.export(sim.model, example, str(path), input_names=["input"], opset_version=21, dynamo=False,
                                export_int32_bias=True)
    print("wrote", path)


export(FIXTURES / "aimet-small-resnet.onnx")
export(FIXTURES / "aimet-sim-small-resnet.onnx", classic=True)
export(FIXTURES / "aimet-w4a8-small-resnet.onnx", weight_bits=4)
export(FIXTURES / "refused" / "aimet-a16w8-small-resnet.onnx", activation_bits=16)
