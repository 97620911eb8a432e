"""How a project uses canzona's pytest plugin: ``PYTHONPATH=. pytest examples/test_sign_momentum.py``
(the ``canzona_exact`` fixture comes with canzona's ``pytest11`` entry point)."""

from __future__ import annotations

import pytest

from examples.sign_momentum import ClippedSignMomentum, SignMomentum
from examples.tiny_mlp import tiny_mlp


def test_sign_momentum_is_exact(canzona_exact):
    canzona_exact(SignMomentum, meshes=["dp2", "dp2xtp2"], optimizer_kwargs={"lr": 0.01})


def test_sign_momentum_on_my_model(canzona_exact):
    canzona_exact(SignMomentum, tiny_mlp, meshes=["tp2"], dtypes=["float32"])


def test_clipped_variant_is_refused(canzona_exact):
    with pytest.raises(pytest.fail.Exception, match="reads other parameters"):
        canzona_exact(ClippedSignMomentum, meshes=["dp2"])
