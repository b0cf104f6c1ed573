"""How every front end starts, in one order: the checks that need nothing, then the cluster, then
what depends on the device, then the weights.

Each front end (``generate``, ``bench``, ``tune``, ``serve``, the harness's model) turns a model
directory and settings into a loaded model. The order matters and is the same for all of them: bad
input (a wrong path, a setting that cannot run on this model) must fail in one line before the
processes of a cluster wait for one another and before minutes of weight loading; the cluster must
start (``jax.distributed``) before anything asks JAX which device it has, and the recommended
setting is chosen per kind of device. ``FrontEndStart`` holds that order so a front end only says
what its settings are.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models import ModelConfig, load_config

from ..core.config import ENTROPY_BOUND_FAMILY, DecodeConfig
from ..model_dir import checked_settings, model_directory, precheck_settings
from ..parallel import multihost
from .flags import cluster_from_flags, weight_options

if TYPE_CHECKING:
    from ..api import LoadedModel


@dataclasses.dataclass
class FrontEndStart:
    """A front end's model directory, its config and the cluster its flags ask for; then, in order,
    ``precheck`` (settings as far as they hold on any device), ``join`` (the cluster), ``settings``
    (checked on this device) and ``load`` (the weights, with the weight flags)."""

    args: argparse.Namespace
    model_dir: Path
    config: ModelConfig
    cluster: multihost.Cluster | None = None

    @classmethod
    def begin(cls, args: argparse.Namespace) -> FrontEndStart:
        """The cluster flags (when the front end has them) and the model directory, checked without
        reading a weight: ``ClusterError``, ``FileNotFoundError`` or ``CheckpointError`` first."""
        cluster = cluster_from_flags(args) if hasattr(args, "coordinator") else None
        model_dir = model_directory(args.model)
        return cls(args, model_dir, load_config(model_dir), cluster)

    @classmethod
    def of_model_args(
        cls, model: str | Path | None, dtype: str = "float32", quantize: str | None = None, mesh: str | None = None
    ) -> FrontEndStart:
        """``begin`` for a front end whose model and weight options come as values, not flags (the
        harness's model: ``pretrained=``, ``dtype=``, ``quantize=``, ``mesh=``): the same checks, and
        no cluster of its own (its command joins the cluster before the harness makes the model)."""
        return cls.begin(argparse.Namespace(model=model, dtype=dtype, quantize=quantize, mesh=mesh))

    @property
    def entropy_bound(self) -> bool:
        """DiffusionGemma: no mask token, its own sampler's settings and names."""
        return self.config.family == ENTROPY_BOUND_FAMILY

    def precheck(self, fields: dict[str, Any] | None = None, name: str | None = None) -> DecodeConfig:
        """``fields`` over the named setting ``name``, checked as far as they hold on every device
        (``model_dir.precheck_settings``): before the cluster waits."""
        settings, _ = precheck_settings(self.model_dir, fields, name)
        return settings

    def join(self) -> None:
        """Join the cluster (no-op on one process): before anything reads the device kind."""
        multihost.start(self.cluster)

    def settings(self, fields: dict[str, Any] | None = None, name: str | None = None) -> DecodeConfig:
        """``fields`` over the named setting ``name`` on this device (a recommendation is chosen per
        device kind), checked against the model's config: after ``join``."""
        settings, _ = checked_settings(self.model_dir, fields, name)
        return settings

    def load(self, loader: Callable[..., LoadedModel] | None = None) -> LoadedModel:
        """The weights, with the front end's ``--dtype``, ``--mesh`` and ``--quantize``, through
        ``api.load_model`` (or the ``loader`` a front end holds in its place: the harness's model
        loads through the name its module imports)."""
        from ..api import load_model

        return (loader or load_model)(self.model_dir, **weight_options(self.args))
