"""A request's token bookkeeping: status, prompt and output tokens, computed tokens, hashes.

The scheduler owns every mutation after `add_request`; drivers only read.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.block_pieces import BlockPieces, within_given


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The stopping rules the engine core enforces (token choice itself is the executor's).

    Attributes:
        max_tokens: output tokens after which the request is length-capped.
        min_tokens: outputs before which the sampler must not produce EOS or stop tokens.
            Like vLLM 0.33, the core still stops on one if it is produced anyway.
        ignore_eos: never stop on `eos_token_id`.
        eos_token_id: the end-of-sequence token, if the model has one.
        stop_token_ids: further tokens that stop the request (reported as `stop_reason`).
    """

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def effective_eos_token_id(self) -> int | None:
        """The EOS id the stop check uses: None under `ignore_eos`."""
        return None if self.ignore_eos else self.eos_token_id


class RequestStatus(enum.IntEnum):
    """Lifecycle states, ordered as in vLLM so that `is_finished` is `status > PREEMPTED`."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """True for the FINISHED_* states (as vLLM: `RequestStatus.is_finished(status)`)."""
        return status > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
}


def finish_reason(status: RequestStatus) -> str | None:
    """OpenAI/vLLM finish reason ("stop", "length", "abort") of a finished status."""
    return _FINISH_REASONS.get(status)


BlockHasher = Callable[["Request"], list[bytes]]
"""Returns the hashes of the request's full blocks not yet in `request.block_hashes`."""


class Request:
    """One generation request inside the engine core.

    Token layout: `all_token_ids = prompt_token_ids + output_token_ids` (kept apart: the
    prompt is never copied to append outputs to it); `num_tokens` is its length.
    `num_computed_tokens` counts the leading tokens whose KV is (or, once the current step
    has run, will be) in the cache; the scheduler advances it when it schedules.
    `block_hashes[i]` is the chained hash of full block i of `all_token_ids`, kept up to date
    on every append when prefix caching is on. A driver may give the leading ones
    (`block_hashes=`): any identity of the blocks' token prefixes that is equal exactly when
    the prefixes are (the simulator's `sim.block_ids`); the rest are hashed after them, or,
    with a `block_key` (no other request can hold a block equal to one of them), named
    `index (8 bytes, little endian) || block_key` (`runtime.block_hash.own_block_names`).
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "arrival_time", "priority",
        "cache_salt", "lora_name", "lora_path", "status", "stop_reason", "num_computed_tokens",
        "num_preemptions", "num_cached_tokens", "block_hashes", "_prompt", "_outputs",
        "_block_hasher", "_hash_block_size", "max_tokens", "num_prompt_tokens", "num_tokens",
        "eos_token_id", "stop_token_ids", "stop_length", "num_external_computed_tokens",
        "block_key", "own_from", "block_pieces", "arrival_order",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_path: str | None = None,
        block_hashes: Sequence[bytes] = (),
        block_key: bytes | None = None,
        block_pieces: BlockPieces | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids  # the caller's sequence, not copied
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time  # seconds, on the driver's clock
        # Its rank among the scheduler's requests by `add_request`: breaks ties of
        # `arrival_time`, which a real server never has (it stamps each request as received).
        self.arrival_order = 0
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.lora_path = lora_path
        self.max_tokens = sampling_params.max_tokens
        self.eos_token_id = sampling_params.effective_eos_token_id  # None under ignore_eos
        self.stop_token_ids = sampling_params.stop_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_tokens = self.num_prompt_tokens  # prompt + outputs
        # The shortest length at which a length rule could stop it (the scheduler tightens
        # it with max_model_len and the pool's capacity); a cheap pre-check per token.
        self.stop_length = self.num_prompt_tokens + self.max_tokens
        self.status = RequestStatus.WAITING
        # Token id for a stop token, or a readable text (e.g. why a request was ignored).
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # Leading tokens whose KV arrives from elsewhere (vLLM's KV connector: a P/D prefill
        # replica): at its first admission the scheduler allocates blocks for them past the
        # local prefix hit and counts them computed. Consumed there (a recompute after a
        # preemption computes them locally).
        self.num_external_computed_tokens = 0
        self.num_preemptions = 0
        # Prefix-cache hit tokens at the first admission; None until admitted.
        self.num_cached_tokens: int | None = None
        # Given hashes of the prompt's leading full blocks (a driver that knows its blocks'
        # identities: `sim.block_ids`); the scheduler's hasher chains on from the last.
        self.block_hashes: list[bytes] = list(block_hashes)
        # Set when no other request's block can equal one of this request's blocks past the
        # given hashes (the simulator's own-stream tokens): those are named, not hashed.
        self.block_key = block_key
        # With a `block_key`: the first block named by it (the given names before it are
        # shared ones); the pool caches such blocks for this request's lookups only.
        self.own_from = len(self.block_hashes) if block_key is not None else None
        # Set when the leading given names come in pieces (`runtime.block_pieces`): the
        # pool files and looks them up piece by piece.
        self.block_pieces = within_given(block_pieces, len(self.block_hashes))
        # 8 bytes per token: a simulator holds thousands of long prompts in its queues (it
        # passes arrays, taken as they are: a copy of a 12,000-token prompt was ~1% of a run).
        self._prompt = (prompt_token_ids if isinstance(prompt_token_ids, array)
                        and prompt_token_ids.typecode == "q" else array("q", prompt_token_ids))
        self._outputs = array("q")
        self._block_hasher: BlockHasher | None = None
        self._hash_block_size = 0  # 0 = not hashing

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> array[int]:
        """Prompt and output tokens (a copy, O(num_tokens): `token_ids` for a range)."""
        return self._prompt + self._outputs

    def token_ids(self, start: int, stop: int) -> array[int]:
        """Tokens `[start, stop)` of prompt + outputs (a copy of that range only)."""
        num_prompt = self.num_prompt_tokens
        if start >= num_prompt:
            return self._outputs[start - num_prompt : stop - num_prompt]
        if stop <= num_prompt:
            return self._prompt[start:stop]
        return self._prompt[start:] + self._outputs[: stop - num_prompt]

    @property
    def last_token_id(self) -> int:
        """The last token: the last output, or the prompt's last before any."""
        return self._outputs[-1] if self._outputs else self._prompt[-1]

    @property
    def output_token_ids(self) -> list[int]:
        """The sampled tokens so far (a copy)."""
        return self._outputs.tolist()

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def set_block_hasher(self, hasher: BlockHasher, block_size: int) -> None:
        """Attach the hasher and hash the prompt's full blocks."""
        self._block_hasher = hasher
        self._hash_block_size = block_size
        self.block_hashes.extend(hasher(self))

    def extend_output_tokens(self, token_ids: Sequence[int]) -> None:
        """Append several sampled tokens at once and hash the blocks they complete."""
        self._outputs.extend(token_ids)
        self.num_tokens += len(token_ids)
        if (self._hash_block_size
                and self.num_tokens // self._hash_block_size > len(self.block_hashes)):
            # set with _hash_block_size (`set_block_hasher`): not None here
            self.block_hashes.extend(self._block_hasher(self))  # type: ignore[misc]

    def append_output_token(self, token_id: int) -> None:
        """Append one sampled token and hash the block it completes, if any."""
        self._outputs.append(token_id)
        self.num_tokens += 1
        if self._hash_block_size and self.num_tokens % self._hash_block_size == 0:
            # set with _hash_block_size (`set_block_hasher`): not None here
            self.block_hashes.extend(self._block_hasher(self))  # type: ignore[misc]
