"""Which streams get the stall timeout (``Migration.arm``): exactly those a stall could still
move to another worker: migration on with a migration left, and a request that can be resumed
elsewhere (``resumable``); every other stream waits as before (``--idle-timeout``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dynamo_zmq.llm import (
    GuidedDecoding,
    Migration,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    resumable,
)


class RecordingStream:
    """What ``arm`` sets on a stream (a real one is a ``ResponseStream``: no stall timeout
    until one is set)."""

    def __init__(self) -> None:
        self.stall: float | None = None

    def set_stall_timeout(self, seconds: float | None) -> None:
        self.stall = seconds


requests = st.builds(
    lambda penalty, n, native, guided: PreprocessedRequest(
        token_ids=[1, 2, 3],
        sampling=SamplingOptions(frequency_penalty=penalty, n=n),
        output=OutputOptions(detokenize=native),
        guided=GuidedDecoding(json_object=True) if guided else None,
    ),
    st.sampled_from([None, 0.0, 0.5]), st.sampled_from([1, 2]), st.booleans(),
    st.booleans(),
)


@given(requests, st.integers(0, 4), st.integers(0, 4), st.sampled_from([None, 0.0, 0.5, 10.0]))
def test_a_stream_is_armed_only_when_a_stall_could_move_it(request, limit, made, stall):
    migration = Migration(object(), request, limit, stall_timeout=stall)  # type: ignore[arg-type]
    migration.migrations = min(made, limit)
    stream = RecordingStream()
    assert migration.arm(stream) is stream  # type: ignore[arg-type]
    can_move = migration.migrations < limit and resumable(request) is None
    assert stream.stall == (stall if stall and can_move else None)
