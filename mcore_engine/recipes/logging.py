"""Progress and metrics of the main job (global rank 0 writes): a tqdm bar, one JSON object per line in
``<run_dir>/metrics.jsonl``, and a PNG of the learning curves (matplotlib, Agg backend).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["RunLogger", "plot_curves", "plot_grpo_curves", "plot_grpo_runs", "read_metrics"]


class RunLogger:
    """Rank-0 progress bar per phase plus the JSON-lines metrics file; a no-op on other ranks."""

    def __init__(self, run_dir: str | Path, *, enabled: bool) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._bar = None
        self._file = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.metrics_path, "w")

    def start_phase(self, description: str, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self._bar is not None:
            self._bar.close()
        self._bar = tqdm(total=total, desc=description, dynamic_ncols=True)

    def log(self, record: dict[str, Any], postfix: dict[str, str] | None = None) -> None:
        """Append ``record`` as one JSON line; advance the bar and show ``postfix`` on it."""
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        tqdm.write(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_path: str | Path, png_path: str | Path, *,
                teacher_floor: float | None = None) -> None:
    """Three panels vs step: teacher loss (``teacher_floor`` dashed), distillation loss, top-k overlap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    teacher = [r for r in records if r.get("phase") == "teacher"]
    student = [r for r in records if r.get("phase") == "student"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    ax.plot([r["step"] for r in teacher], [r["loss"] for r in teacher], label="teacher CE")
    if teacher_floor is not None:
        ax.axhline(teacher_floor, ls="--", c="gray", label="corpus entropy rate")
    ax.set(title="teacher: next-token cross-entropy", xlabel="step", ylabel="nats / token")
    ax.legend()
    ax = axes[1]
    ax.plot([r["step"] for r in student], [r["distillation_loss"] for r in student], c="C1")
    ax.set(title="student: top-k KL to teacher", xlabel="step", ylabel="nats / token")
    ax = axes[2]
    ax.plot([r["step"] for r in student], [r["topk_overlap"] for r in student], c="C2", label="top-k overlap")
    ax.plot([r["step"] for r in student], [r["student_mass"] for r in student], c="C3", ls=":",
            label="student mass on teacher top-k")
    ax.plot([r["step"] for r in student], [r["teacher_mass"] for r in student], c="gray", ls="--",
            label="teacher mass on its top-k")
    ax.set(title="student vs teacher top-k", xlabel="step", ylim=(0, 1.02))
    ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def plot_grpo_curves(metrics_path: str | Path, png_path: str | Path, *, chance: float | None = None) -> None:
    """Three panels vs step (``phase == "grpo"`` records): mean reward (+- one std, ``chance`` dashed),
    KL to the reference and clip fraction, entropy of the rollout policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(metrics_path) if r.get("phase") == "grpo"]
    steps = [r["step"] for r in records]
    mean = [r["reward_mean"] for r in records]
    std = [r["reward_std"] for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    ax = axes[0]
    ax.plot(steps, mean, label="mean reward")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)], alpha=0.2, label="+- std over responses")
    if chance is not None:
        ax.axhline(chance, ls="--", c="gray", label="uniform policy")
    ax.set(title="GRPO: reward of the rollouts", xlabel="step", ylabel="reward", ylim=(0, 1.02))
    ax.legend()
    ax = axes[1]
    if all("kl" in r for r in records):
        ax.plot(steps, [r["kl"] for r in records], c="C1", label="KL to reference")
    ax.plot(steps, [r["pg_clipfrac"] for r in records], c="C2", ls=":", label="clip fraction")
    ax.set(title="KL to the initial policy, PPO clip fraction", xlabel="step")
    ax.legend()
    ax = axes[2]
    ax.plot(steps, [r["entropy"] for r in records], c="C3")
    ax.set(title="entropy of the rollout policy", xlabel="step", ylabel="nats / token")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def plot_grpo_runs(runs: Mapping[str, str | Path], png_path: str | Path, *, chance: float | None = None,
                   title: str | None = None) -> None:
    """Several GRPO runs in one figure, ``runs``: legend label -> ``metrics.jsonl`` (or its run folder).
    Three panels vs step, one colour per run (legend below): mean reward (``chance`` dashed), KL to
    the reference (runs that log it), entropy of the rollout policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(runs) + 1 + 2) // 3                            # legend rows below the panels (3 per row)
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8 + 0.25 * rows))
    for i, (label, path) in enumerate(runs.items()):
        path = Path(path)
        records = [r for r in read_metrics(path / "metrics.jsonl" if path.is_dir() else path)
                   if r.get("phase") == "grpo"]
        steps = [r["step"] for r in records]
        style = {"c": f"C{i}", "label": label}
        axes[0].plot(steps, [r["reward_mean"] for r in records], **style)
        if records and all("kl" in r for r in records):
            axes[1].plot(steps, [r["kl"] for r in records], **style)
        axes[2].plot(steps, [r["entropy"] for r in records], **style)
    if chance is not None:
        axes[0].axhline(chance, ls="--", c="gray", label="uniform policy")
    axes[0].set(title="mean reward of the rollouts", xlabel="step", ylabel="reward", ylim=(0, 1.02))
    axes[1].set(title="KL to the reference (response tokens)", xlabel="step", ylabel="nats / token")
    axes[2].set(title="entropy of the rollout policy", xlabel="step", ylabel="nats / token")
    for ax in axes:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.25 * rows / (3.8 + 0.25 * rows) + 0.02, 1, 1))
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
