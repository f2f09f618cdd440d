"""The endpoint of `rt replay --endpoint`: where it is (its URL in any of the accepted forms)
and what it serves (`GET /v1/models`: the model name, its max_model_len; `GET /metrics`:
vLLM's `vllm:cache_config_info` labels, the KV pool), checked before a replay starts.
`EndpointError` is the one-line error for an endpoint that cannot be used."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import httpx


class EndpointError(ValueError):
    """The endpoint cannot be used (bad URL, unreachable, no such model): one line."""


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    """How to reach the server and what to send.

    Attributes:
        url: the server (`http://host:port`), its `/v1` root, or the full
            `/v1/completions` URL.
        model: the `model` of the request body (vLLM's served model name); None: the first
            id of `GET /v1/models`.
        api_key: sent as `Authorization: Bearer <key>`, or None.
        max_concurrency: requests in flight at most (a client semaphore), or None.
        timeout_s: seconds one request may take in all (connect to the last chunk).
        vocab_size: prompt token ids are drawn from [10, vocab_size).
        seed: seed of the trace's token ids.
    """

    url: str
    model: str | None = None
    api_key: str | None = None
    max_concurrency: int | None = None
    timeout_s: float = 600.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size <= 10:
            raise EndpointError(f"--vocab-size must be > 10, got {self.vocab_size}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise EndpointError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.timeout_s > 0:
            raise EndpointError(f"--timeout must be > 0 s, got {self.timeout_s}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """What `probe` learned: the completions URL, the model name to send, the served
    model's `max_model_len` (vLLM lists it in /v1/models; None when not given) and the KV
    pool the server exports on /metrics (`cache_config`: block_size, num_gpu_blocks (the
    pool's blocks, vLLM's null block included), enable_prefix_caching; only those found)."""

    completions_url: str
    model: str
    max_model_len: int | None
    cache_config: dict[str, int | bool] = field(default_factory=dict)


# A URL's user:password@ (greedy to a word's last "@": a password may hold "/" or "@")
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^\s'\"]*@")


def redacted(text: str) -> str:
    """`text` (a URL, or a line holding URLs) with each URL's credentials shown as `***`:
    what every line or record that shows an endpoint's URL prints. The request itself
    still sends them (HTTP basic auth)."""
    return _USERINFO.sub(r"\1***@", text)


def completions_url(url: str) -> str:
    """`/v1/completions` under `url` (a server root, its `/v1`, or the completions URL
    itself); EndpointError unless it is an http(s) URL with a host."""
    shown = redacted(url)
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:  # its text may quote the password
        detail = f" ({exc})" if shown == url else ""
        raise EndpointError(f"--endpoint {shown!r}: not a URL{detail}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise EndpointError(f"--endpoint {shown!r}: expected http(s)://HOST[:PORT][/v1]")
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        raise EndpointError(f"--endpoint {shown!r}: port {parsed.port} is not in [1, 65535]")
    path = parsed.path.rstrip("/")
    if not path.endswith("/completions"):
        path += "/completions" if path.endswith("/v1") else "/v1/completions"
    return str(parsed.copy_with(path=path, query=None, fragment=None))


# A probe's answer (/v1/models, /metrics) at most: a vLLM server's /metrics is ~100 KB
MAX_PROBE_BYTES = 16 * 2**20


def bounded_get(url: str, headers: dict[str, str], timeout_s: float) -> httpx.Response:
    """GET `url`, its whole answer within `timeout_s` seconds and `MAX_PROBE_BYTES`
    (httpx's timeouts bound each read, not the answer: a server dripping a byte a second
    never timed out); httpx.TimeoutException / ReadError otherwise."""
    deadline = time.monotonic() + timeout_s
    body = bytearray()
    with httpx.stream("GET", url, headers=headers, timeout=timeout_s) as response:
        for chunk in response.iter_bytes():
            body += chunk
            if time.monotonic() > deadline:
                raise httpx.ReadTimeout(f"no complete answer in {timeout_s:g} s")
            if len(body) > MAX_PROBE_BYTES:
                raise httpx.ReadError(f"an answer past {MAX_PROBE_BYTES >> 20} MB")
    kept = {k: v for k, v in response.headers.items()  # the body is decoded and whole
            if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")}
    return httpx.Response(response.status_code, content=bytes(body), headers=kept,
                          request=response.request)  # (raise_for_status needs it)


# A GET of one of rt's own servers (a replica's or the router's /metrics, /health), in all (s)
OWN_SERVER_TIMEOUT_S = 10.0


def own_get(url: str) -> httpx.Response:
    """GET a page of one of rt's own servers (`rt serve` replicas, `rt route`): its whole
    answer within `OWN_SERVER_TIMEOUT_S` (`bounded_get`; a replica stuck mid-answer once
    held fleet fidelity, `rt bench serve` and the soak forever)."""
    return bounded_get(url, {}, OWN_SERVER_TIMEOUT_S)


def models_url(completions: str) -> str:
    """The `/v1/models` URL next to a `/v1/completions` URL."""
    return completions.removesuffix("/completions") + "/models"


def probe(config: EndpointConfig) -> EndpointInfo:
    """`GET /v1/models`: the endpoint must answer (any status); the model name is the
    configured one (which must be listed, when the server lists models) or the first listed.
    EndpointError, one line, otherwise."""
    url = completions_url(config.url)
    try:
        response = bounded_get(models_url(url), config.headers, min(config.timeout_s, 30.0))
    except httpx.HTTPError as exc:
        raise EndpointError(f"cannot reach {redacted(url)}: {describe_error(exc)}") from None
    models = _listed_models(response)
    if config.model is None:
        if not models:
            raise EndpointError(f"{redacted(models_url(url))} lists no model (HTTP "
                                f"{response.status_code}); give --served-model-name")
        name = next(iter(models))
    else:
        name = config.model
        if models and name not in models:
            raise EndpointError(f"{redacted(url)} does not serve model {name!r} (it serves "
                                f"{', '.join(models)})")
    max_len = models.get(name)
    return EndpointInfo(url, name, max_len if isinstance(max_len, int) else None,
                        scrape_cache_config(url, config))


def metrics_url(completions: str) -> str:
    """The server's `/metrics` URL (beside its `/v1`) from its `/v1/completions` URL."""
    return completions.removesuffix("/completions").removesuffix("/v1") + "/metrics"


def scrape_cache_config(completions: str, config: EndpointConfig) -> dict[str, int | bool]:
    """`cache_config_labels` of `GET /metrics`; {} when the server has no /metrics (an
    endpoint need not export anything: the engine flags are the fallback)."""
    try:
        response = bounded_get(metrics_url(completions), config.headers,
                               min(config.timeout_s, 30.0))
    except httpx.HTTPError:
        return {}
    return cache_config_labels(response.text) if response.status_code == 200 else {}


_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_INT_LABELS = ("block_size", "num_gpu_blocks")


def cache_config_labels(text: str) -> dict[str, int | bool]:
    """block_size, num_gpu_blocks (ints) and enable_prefix_caching (bool) from the first
    `vllm:cache_config_info{...}` sample of a Prometheus text exposition; a label that is
    absent or not a number (vLLM writes "None" before the KV pool is sized) is left out."""
    match = _INFO_LINE.search(text)
    if match is None:
        return {}
    labels = dict(_LABEL.findall(match["labels"]))
    out: dict[str, int | bool] = {}
    for name in _INT_LABELS:
        if labels.get(name, "").isdigit() and int(labels[name]) > 0:
            out[name] = int(labels[name])
    flag = labels.get("enable_prefix_caching", "").lower()
    if flag in ("true", "false"):
        out["enable_prefix_caching"] = flag == "true"
    return out


def _listed_models(response: httpx.Response) -> dict[str, object]:
    """id -> max_model_len (or None) of an OpenAI `/v1/models` answer; {} if it is none."""
    if response.status_code != 200:
        return {}
    try:
        data = response.json().get("data")
    except (ValueError, AttributeError):
        return {}
    if not isinstance(data, list):
        return {}
    return {str(m["id"]): m.get("max_model_len") for m in data
            if isinstance(m, dict) and "id" in m}


def describe_error(exc: BaseException) -> str:
    """A transport error in one line: its type, and its message when it has one."""
    text = redacted(str(exc).strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
