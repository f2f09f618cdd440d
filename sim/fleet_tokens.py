"""What a fleet's routers are told about a request's tokens and blocks, and which token ids a
replica gets: the trace's, or placeholders when nobody reads them (`sim.block_ids`)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from sim.simulator import EngineProcess, SimConfig
from workloads import TraceRequest
from workloads.tokens import prompt_token_array, request_token_arrays

_ZERO = array("q", (0,))  # a placeholder token id


def router_known(first: EngineProcess, req: TraceRequest, block_size: int | None) -> list[bytes]:
    """The identities of the prompt's leading blocks as the replicas' pools name them
    (`EngineProcess.known_hashes`; routers key blocks by `block_size` and hash the first
    replica's tokens); [] without a KV-event router."""
    cfg = first.config
    if block_size is None or not cfg.trace_block_ids:
        return []
    return first.block_ids.prompt_ids(req, block_size, cfg.vocab_size, cfg.seed)


def routing_tokens(first: EngineProcess, req: TraceRequest, block_size: int | None,
                   token_blind: bool, spare_output: bool = False
                   ) -> tuple[array[int], array[int], list[bytes], bool]:
    """The prompt and output token ids the routers see (the first replica's), the known
    block identities (`router_known`), and whether any of the token ids are placeholders:
    all of them only when no router reads them (`token_blind`), the first replica does not
    either (`EngineProcess.tokens_unread`) and every full block is named (no router hashes
    them); with `spare_output`, the output alone whenever the first replica reads no token
    (routers read prompts only; its arrays cost a fifth of the routers' on the default
    trace). The caller gives the chosen replica the trace's tokens if it reads them
    (`replica_inputs`)."""
    known = router_known(first, req, block_size)
    unread = first.tokens_unread(req)
    placeholders = (token_blind and unread
                    and (block_size is None or len(known) == req.prompt_len // block_size))
    if placeholders:
        prompt, output = first.token_arrays(req)
    elif spare_output and unread:
        prompt = prompt_token_array(req, first.config.vocab_size, first.config.seed)
        output = _ZERO * req.output_len
        placeholders = True
    else:
        prompt, output = request_token_arrays(req, first.config.vocab_size, first.config.seed)
    return prompt, output, known, placeholders


def replica_inputs(replica: EngineProcess, first: SimConfig, req: TraceRequest,
                   prompt: array[int], output: array[int], placeholders: bool,
                   routed: Sequence[bytes]) -> tuple[array[int], array[int], Sequence[bytes]]:
    """The token ids and known block names the chosen replica gets: the routers' (computed
    on `first`'s tokens), unless its vocabulary or seed differs (its own tokens, no names)
    or it reads tokens the routers had as placeholders."""
    cfg = replica.config
    if (cfg.vocab_size, cfg.seed) != (first.vocab_size, first.seed):
        return (*replica.token_arrays(req), ())
    # a replica of the first one's config reads what it reads (`tokens_unread`: config and
    # the fleet's shared block identities only)
    if placeholders and cfg is not first and not replica.tokens_unread(req):
        prompt, output = request_token_arrays(req, cfg.vocab_size, cfg.seed)
    # the routers' hashes are the replica's own (same tokens, block size, naming)
    return prompt, output, routed if cfg.cache.enable_prefix_caching else ()
