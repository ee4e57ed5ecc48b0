"""A recipe's metrics: one JSON line per step in `metrics.jsonl`, plots, optionally MLflow.

The JSON lines are the record of truth (tests and the README read them back); plots are
drawn from them with matplotlib's Agg backend, so no display is needed. A resumed recipe
appends to the same file, so a step can appear twice; readers of a plot see the last value.
MLflow is imported only when a tracking URI is given: it is not a dependency.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Appends steps' metrics to `log_dir/metrics.jsonl` (and MLflow when configured)."""

    def __init__(self, log_dir: Path, mlflow_uri: str | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / METRICS_FILE
        self._mlflow: Any = None
        if mlflow_uri is not None:
            self._mlflow = _start_mlflow(mlflow_uri, self.log_dir.name)
        self._file = self.path.open("a")

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record `values` for `step`: one line, flushed at once so a crash keeps it."""
        self._file.write(json.dumps({"step": step, **values}) + "\n")
        self._file.flush()
        if self._mlflow is not None:
            self._mlflow.log_metrics(values, step=step)

    def plot(self, keys: list[str], name: str) -> Path:
        """Draw `keys` against the step into `log_dir/name.png`; returns its path.

        Raises:
            ValueError: none of `keys` was ever logged.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = read(self.log_dir)
        figure, axes = plt.subplots(figsize=(6, 3.5))
        drawn = 0
        for key in keys:
            by_step = {row["step"]: row[key] for row in rows if key in row}
            if by_step:
                steps = sorted(by_step)
                axes.plot(steps, [by_step[step] for step in steps], marker=".", label=key)
                drawn += 1
        if not drawn:
            plt.close(figure)
            raise ValueError(f"no values logged for {keys} in {self.path}; log them first")
        axes.set_xlabel("step")
        axes.legend()
        axes.grid(alpha=0.3)
        figure.tight_layout()
        path = self.log_dir / f"{name}.png"
        figure.savefig(path, dpi=80)
        plt.close(figure)
        return path

    def close(self) -> None:
        """Close the file and end the MLflow run, if any."""
        self._file.close()
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None


def read(log_dir: Path) -> list[dict[str, Any]]:
    """Every line of `log_dir/metrics.jsonl`, in order; [] when there is none."""
    path = Path(log_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start_mlflow(uri: str, run_name: str) -> Any:
    try:
        import mlflow
    except ImportError:
        raise ImportError(
            f"mlflow_uri={uri!r} needs the mlflow package: pip install mlflow, "
            "or leave mlflow_uri unset"
        ) from None
    mlflow.set_tracking_uri(uri)
    mlflow.start_run(run_name=run_name)
    return mlflow
