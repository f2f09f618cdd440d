"""rt's engine core: vLLM-V1 scheduling over a paged KV cache with prefix caching.

Pure Python standard library: no clock, no I/O, no torch. The simulator and the real engine
both drive this same core.
"""

from runtime.batch import BatchFeatures, batch_features
from runtime.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from runtime.config import CacheConfig, SchedulerConfig
from runtime.engine import EngineCore, ScheduledStep
from runtime.kv_cache_manager import KVCacheManager
from runtime.outputs import (
    CachedRequestData,
    NewRequestData,
    PrefixCacheStats,
    SchedulerOutput,
    WaitReason,
)
from runtime.recorder import Recorder
from runtime.records import RequestRecord, StepRecord
from runtime.request import Request, RequestStatus, SamplingParams, finish_reason
from runtime.scheduler import Scheduler

__all__ = [
    "BatchFeatures",
    "BlockPool",
    "CacheConfig",
    "CachedRequestData",
    "EngineCore",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "NewRequestData",
    "PrefixCacheStats",
    "Recorder",
    "Request",
    "RequestRecord",
    "RequestStatus",
    "SamplingParams",
    "ScheduledStep",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepRecord",
    "WaitReason",
    "batch_features",
    "finish_reason",
]
