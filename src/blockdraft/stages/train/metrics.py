"""Training metrics: one JSON line per logged step, and a PNG of the loss and the per-slot accuracies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "training-curves.png"


class MetricsLog:
    """Appends entries to `folder/metrics.jsonl` and keeps them for the plot."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / METRICS_NAME
        self.plot_path = folder / PLOT_NAME
        self.entries: list[dict[str, Any]] = []

    def restart_from(self, checkpoint_folder: Path, step: int) -> None:
        """Continue the log of a resumed run: the checkpoint's entries up to `step`, nothing a crashed run wrote after."""
        source = checkpoint_folder / METRICS_NAME
        lines = source.read_text().splitlines() if source.is_file() else []
        self.entries = [e for e in map(json.loads, lines) if e["step"] <= step]
        self.path.write_text("".join(json.dumps(e) + "\n" for e in self.entries))

    def start_fresh(self) -> None:
        self.entries = []
        self.path.write_text("")

    def append(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def plot(self) -> Path:
        """Loss (log scale) and accuracy of each draft slot against the step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [e["step"] for e in self.entries]
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
        ax_loss.plot(steps, [e["loss"] for e in self.entries], color="black")
        ax_loss.set_yscale("log")
        ax_loss.set_xlabel("step")
        ax_loss.set_title("loss (weighted CE)")
        if self.entries:
            num_slots = len(self.entries[0]["slot_accuracy"])
            cmap = plt.get_cmap("viridis", max(num_slots, 2))
            for k in range(num_slots):
                ax_acc.plot(steps, [e["slot_accuracy"][k] for e in self.entries], color=cmap(k), label=f"slot {k + 1}")
            ax_acc.legend(fontsize=7, ncol=2)
        ax_acc.set_ylim(0, 1)
        ax_acc.set_xlabel("step")
        ax_acc.set_title("per-slot accuracy")
        fig.tight_layout()
        fig.savefig(self.plot_path, dpi=90)
        plt.close(fig)
        return self.plot_path
