"""The deployment spec a point was measured with, as serving's type.

``PointConfig.spec`` keeps it as the JSON the results file holds: the results sit below serving, and a
point's key (what a resumed sweep skips) is the digest of that JSON, so it stays as written. Everything that
reads a point's spec reads it here, typed.
"""

from __future__ import annotations

from ..results import PointConfig
from ..serving.spec import DeploymentSpec


def measured_spec(config: PointConfig) -> DeploymentSpec | None:
    """The ``DeploymentSpec`` behind ``config``; None for a point measured on an external endpoint (no spec)."""
    if not config.spec:
        return None
    try:
        return DeploymentSpec.model_validate(config.spec)
    except ValueError as exc:
        raise ValueError(f"{config.deployment} at {config.load}: its recorded deployment spec is not one this "
                         f"version reads: {exc}") from exc
