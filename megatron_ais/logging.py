"""Console lines, tensorboard scalars and the run summary; only the designated logging rank writes."""
from __future__ import annotations

import json
import os
import sys
from typing import Any


class RunLogger:
    """One console line per step, tensorboard scalars and summary.json for a run directory."""

    def __init__(self, output_dir: str, tensorboard_dir: str | None, enabled: bool):
        self.enabled = enabled
        self.output_dir = output_dir
        self.writer = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir or os.path.join(output_dir, "tensorboard"))

    def step(self, step: int, scalars: dict[str, float], line: str) -> None:
        """Write the step's scalars to tensorboard and print its console line."""
        if not self.enabled:
            return
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)
        print(line, flush=True)

    def info(self, message: str) -> None:
        """Print a message from the logging rank."""
        if self.enabled:
            print(message, file=sys.stderr, flush=True)

    def summary(self, data: dict[str, Any]) -> None:
        """Write summary.json and flush tensorboard."""
        if not self.enabled:
            return
        with open(os.path.join(self.output_dir, "summary.json"), "w") as f:
            json.dump(data, f, indent=2)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
