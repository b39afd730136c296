"""One ExpertManager's part of a checkpoint: its experts' LoRA and AdamW state, beside the other workers'.

Every worker writes its own part in parallel with the others (`vela_ray.training.checkpoint` names the
files and finalizes the checkpoint). The ExpertManager holds one `ExpertCheckpointParts`:

    parts = ExpertCheckpointParts(worker=2)
    parts.snapshot(parts_dir, states)          # copies now, writes experts/part-2.safetensors on a thread
                                               # (uploads it, on object storage: checkpoint.parts_dir)
    path = parts.finish(timeout_s=0.0)         # None while still writing (the master polls)
    states = read_part_states(checkpoint_dir, keys)   # whichever worker wrote them
"""

from __future__ import annotations

from vela_ray.errors import ExpertWorkerError
from vela_ray.model.experts import ExpertKey
from vela_ray.training import checkpoint
from vela_ray.training.rehosting import ExpertStates


class ExpertCheckpointParts:
    """Writes worker `worker`'s checkpoint parts, at most one at a time, on a thread of this process."""

    def __init__(self, worker: int):
        self.worker = worker
        self._write: checkpoint.Background[str] | None = None  # the part being written, if any

    def snapshot(self, staging_dir: str, states: ExpertStates) -> None:
        """Write `states` (already copied: the next step cannot change them) into the staging directory
        on a thread; `finish` waits. An abandoned checkpoint's write is waited for first."""
        previous = self._write
        if previous is not None:
            previous.join()
        tensors = checkpoint.expert_part_tensors(states)

        def write() -> str:
            return checkpoint.write_part(staging_dir, self.worker, tensors)

        self._write = checkpoint.Background(write, name=f"vela-checkpoint-part-{self.worker}")

    def finish(self, timeout_s: float | None = None) -> str | None:
        """The file `snapshot` writes, once written; None if still writing after `timeout_s` (None: wait).
        The master polls with 0 while training goes on: a blocked actor would hold up the rows of the
        step in flight. Answers alike until the next snapshot; a failed write raises."""
        write = self._write
        if write is None:
            raise ExpertWorkerError(self.worker, "no checkpoint part is being written; call "
                                                 "snapshot_checkpoint_part first")
        if not write.join(timeout_s):
            return None
        try:
            return write.result()
        except Exception as exc:
            raise ExpertWorkerError(self.worker, f"writing its checkpoint part failed with "
                                                 f"{type(exc).__name__}: {exc}") from exc


def read_part_states(checkpoint_dir: str, keys: list[ExpertKey]) -> ExpertStates:
    """LoRA and AdamW state of `keys` from a finalized checkpoint (a directory, or a URI on object storage),
    whichever worker wrote them."""
    return checkpoint.read_expert_states_at(checkpoint_dir, keys)
