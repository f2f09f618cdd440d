"""`rt replay --endpoint`'s run: probe the server, check the trace fits its max_model_len,
replay (client-side timing), write the run directory, tell the user. Failed requests are
counted (exit 0, as vLLM bench) unless every request failed (exit 1); Ctrl-C: 130."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.replay.endpoint import EndpointResult, Progress, replay_endpoint, run_info
from backends.replay.endpoint_probe import EndpointConfig, EndpointInfo, probe, redacted
from backends.replay.run_output import INTERRUPTED, RunOutput
from workloads import Trace, check_max_model_len, trace_info


def connect(trace: Trace, settings: Mapping[str, Any]) -> tuple[EndpointConfig, EndpointInfo]:
    """The endpoint's config and what it serves; EndpointError (a ValueError) when it cannot
    be reached or does not serve the model, ValueError when a request exceeds its
    max_model_len."""
    config = EndpointConfig(**settings)
    info = probe(config)
    if info.max_model_len is not None:
        check_max_model_len(trace, info.max_model_len)
    return config, info


@dataclass(frozen=True)
class EndpointRun:
    """One replay against an endpoint: its result and where it ran."""

    result: EndpointResult
    config: EndpointConfig
    info: EndpointInfo

    @classmethod
    def replay(cls, trace: Trace, config: EndpointConfig, info: EndpointInfo,
               progress: Progress | None = None) -> EndpointRun:
        return cls(replay_endpoint(trace, config, info, progress), config, info)

    def rows(self) -> list[dict[str, Any]]:
        return [r.to_row() for r in self.result.requests]

    def run_json(self) -> dict[str, Any]:
        """run.json's endpoint fields (the caller adds kind, name, trace and version)."""
        return run_info(self.result, self.config, self.info)

    @property
    def answered(self) -> bool:
        """Some request did not fail: there are metrics to print."""
        return len(self.result.requests) > self.result.num_failed

    def messages(self, path: Path) -> list[str]:
        """What to say on stderr after the metrics: failures, the run directory, the end."""
        result, lines = self.result, []
        failed, sent = result.num_failed, len(result.requests)
        first = next(iter(result.errors.items()), ("", ""))
        if failed:
            lines.append(f"note: {failed} of {sent} requests failed (first: {first[0]}: "
                         f"{first[1]}); messages in {path / 'run.json'}")
        lines.append(f"wrote {path} ({sent} requests, client-side timing, "
                     f"{result.wall_s:.2f} s wall)")
        if result.interrupted:
            lines.append(INTERRUPTED)
        elif sent and failed == sent:
            lines.append(f"every request failed ({first[1]})")
        return lines

    @property
    def exit_code(self) -> int:
        sent = len(self.result.requests)
        if self.result.interrupted:
            return 130
        return 1 if sent and self.result.num_failed == sent else 0


def run_endpoint(trace: Trace, settings: Mapping[str, Any], path: Path,
                 percentiles: Sequence[float], out: RunOutput) -> None:
    """Replay `trace` against the endpoint (`settings`: `EndpointConfig`'s fields), write run
    directory `path`, show vLLM's block when a request was answered, then the messages;
    exit 1 when every request failed, 130 on Ctrl-C."""
    config, info = connect(trace, settings)
    out.say(f"note: endpoint {redacted(info.completions_url)}, model {info.model}, "
            "client-side timing")
    with out.progress("replaying", len(trace)) as update:
        run = EndpointRun.replay(trace, config, info, update)
    out.write(path, "endpoint", trace_info(trace), run.rows(), run.run_json())
    if run.answered:
        out.show(path, None, percentiles)
    for line in run.messages(path):
        out.say(line)
    if run.exit_code:
        out.exit(run.exit_code)
