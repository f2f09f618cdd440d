"""What the hardware costs the simulator: step time, API-server time, KV-pool memory.

* `base`: the `CostModel` protocol the simulator asks for step times, and its bulk form for
  runs of plain decode steps (`decode_run_timer`).
* `roofline`: `RooflineCostModel`, per-operator roofline from model shapes and a GPU datasheet.
* `profile_model`: `ProfileCostModel`, a fitted non-negative linear combination of the step
  features, loaded from a JSON profile (`sim.profile`).
* `api_server`: `ApiServerCost`, the API server's CPU time per request.
* `kv_cache_sizing`: the KV pool vLLM would allocate per GPU, and vLLM's two start-up lines.

Formulas and numbers: `/work/shared/reference/models_and_gpus.md` (§3 measured efficiencies,
§4 roofline formulas). Times are in seconds, sizes in bytes, rates in FLOP/s or B/s.
"""
