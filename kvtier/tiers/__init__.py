"""Scheduler-side bookkeeping of kvtier: tiers, policies, the cascading
hierarchy and its residency events. Pure Python: no I/O, no vLLM."""

from kvtier.tiers.events import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    TIER_MEDIA,
    TierEvent,
    replay,
)
from kvtier.tiers.hierarchy import TierHierarchy
from kvtier.tiers.plans import (
    BlockLocation,
    HierarchyStats,
    LoadPlan,
    PromoteOrder,
    Residency,
    SpillOrder,
    StorePlan,
    TransferItem,
)
from kvtier.tiers.policy import (
    POLICY_REGISTRY,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
    policy_names,
    register_policy,
)
from kvtier.tiers.scan_resistant import ARCPolicy
from kvtier.tiers.slots import BlockState, TierBlock
from kvtier.tiers.tier import Tier

__all__ = [
    "ARCPolicy",
    "BlockLocation",
    "BlockState",
    "EvictionPolicy",
    "HierarchyStats",
    "LRUPolicy",
    "LoadPlan",
    "TIER_MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "POLICY_REGISTRY",
    "PromoteOrder",
    "Residency",
    "SpillOrder",
    "StorePlan",
    "Tier",
    "TierBlock",
    "TierEvent",
    "TierHierarchy",
    "TransferItem",
    "make_policy",
    "policy_names",
    "register_policy",
    "replay",
]
