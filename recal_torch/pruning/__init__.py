"""Pruning's tensor work: masks exact to the count the core asks for (magnitude, structured, channel-coupled),
the second-order steps (OBS, M-FAC), and :class:`MaskState`, which keeps a model's masks for the manager.

- :mod:`~recal_torch.pruning.magnitude`: unstructured and structured magnitude masks;
- :mod:`~recal_torch.pruning.channels`: filter / channel masks over the core's channel groups;
- :mod:`~recal_torch.pruning.obs` and :mod:`~recal_torch.pruning.mfac`: Optimal BERT Surgeon and M-FAC;
- :mod:`~recal_torch.pruning.masks`: which masks, recomputed when the core's plan says, applied after every step.

An internal room: it declares no ``__all__``; what a user imports is :mod:`recal_torch`'s.
"""

from .channels import expand, group_masks
from .magnitude import joint_magnitude_masks, magnitude_mask, nonzero_mask, structured_mask
from .masks import MaskState
