"""What a recipe sets in the training loop besides masks and quantizers: each param group's LR and weight decay
(:mod:`~recal_torch.training.param_groups`), ``requires_grad`` (:mod:`~recal_torch.training.trainable`) and the
distillation loss (:mod:`~recal_torch.training.distillation`); and recal's own param groups kept apart in an
optimizer's checkpoint (:mod:`~recal_torch.training.learned_groups`).

An internal room: it declares no ``__all__``; what a user imports is :mod:`recal_torch`'s.
"""

from .distillation import Teacher, distillation_loss
from .learned_groups import LR_FACTOR_KEY, join_learned_groups, split_learned_groups
from .param_groups import ParamGroupSettings, follow_recipe, group_bases, schedule_added_group
from .trainable import TrainableFlags
