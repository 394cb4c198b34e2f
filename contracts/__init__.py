"""Sluice event contracts: the envelope, versioned models and their registry."""

from contracts import events as _events  # noqa: F401  (fills the registry)
from contracts.envelope import Envelope
from contracts.registry import REGISTRY, ContractError, Decoded, Registry

__all__ = ["REGISTRY", "ContractError", "Decoded", "Envelope", "Registry"]
