"""Errors a run, or a prediction, can end with. Each carries what a person needs to find the fault."""


class RankError(RuntimeError):
    """A rank raised (or died). ``rank`` is the culprit, not the first peer to notice.

    ``traceback`` is the culprit's full original traceback; ``peers`` maps every other failed
    rank to a one-line summary (usually a connection error caused by the culprit).
    """

    def __init__(self, rank, exc_type, message, traceback, peers=None, step=None):
        self.rank, self.exc_type, self.message = rank, exc_type, message
        self.traceback, self.peers, self.step = traceback, dict(peers or {}), step
        where = f" at step {step}" if step is not None else ""
        text = f"rank {rank} failed{where}: {exc_type}: {message}"
        if traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{traceback.rstrip()}"
        for r, summary in sorted(self.peers.items()):
            text += f"\n(rank {r} then failed too: {summary})"
        super().__init__(text)

    def __reduce__(self):
        return (RankError, (self.rank, self.exc_type, self.message, self.traceback,
                            self.peers, self.step))


class RankStalled(RuntimeError):
    """One or more ranks sent nothing for ``timeout_s`` seconds; the run was ended."""

    def __init__(self, ranks, last_steps, timeout_s, starting=False):
        self.ranks, self.last_steps, self.timeout_s = list(ranks), dict(last_steps), timeout_s
        self.starting = starting
        where = ", ".join(f"rank {r} (last step {last_steps.get(r)})" for r in self.ranks)
        if starting:
            super().__init__(
                f"{where} did not start within {timeout_s}s (importing, or joining the process "
                f"group); every rank was ended. Check the rank output for a hang at start-up.")
            return
        super().__init__(
            f"no progress for {timeout_s}s from {where}; every rank was ended. A collective that "
            f"never completes (one rank waiting for a peer that skipped it, e.g. uneven inputs) "
            f"looks like this. Raise stall_timeout_s if a step legitimately takes that long.")

    def __reduce__(self):
        return (RankStalled, (self.ranks, self.last_steps, self.timeout_s, self.starting))


class TraceError(ValueError):
    """The model could not be built or run on fake tensors (the estimate, the simulated step).
    ``stage``: 'building the model', 'installing the checkpoint policy', 'the forward' or 'the
    step'; ``op``: the aten op a fake tensor could not run, where one is known. The message says
    what the user can do."""

    def __init__(self, message, stage=None, op=None):
        super().__init__(message)
        self.stage, self.op = stage, op

    def __reduce__(self):
        return (TraceError, (str(self), self.stage, self.op))
