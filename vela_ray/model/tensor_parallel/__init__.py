"""Tensor parallelism of the master's backbone (issue 37); being split by concern (issue 51): for now all of it
is in `backbone`."""

from vela_ray.model.tensor_parallel.backbone import *  # noqa: F401,F403
