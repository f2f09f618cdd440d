"""What the fleet tests share: the trace fixtures, one cost model (Llama-3.1-8B on an H200,
roofline) and a replica setup (`sim.fleet.ReplicaSetup`'s shape: a config and a cost model)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sim.cost.base import CostModel
from sim.cost.roofline import RooflineCostModel
from sim.hardware import resolve_gpu
from sim.model_presets import resolve_model
from sim.simulator import SimConfig

FIXTURES = Path(__file__).parents[1] / "fixtures" / "traces"
COST = RooflineCostModel(resolve_model("llama-3.1-8b"), resolve_gpu("h200"))


@dataclass(frozen=True)
class Replica:
    config: SimConfig
    cost_model: CostModel = COST
