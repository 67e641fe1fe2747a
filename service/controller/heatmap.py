"""The profile as a picture: slowdown of verifying k × w drafted tokens vs one token (the
numbers: `cost_profile.slowdown_grid`, which the status route serves without matplotlib)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from service.controller.cost_profile import CostProfile, slowdown_grid  # noqa: E402


def write_heatmap(
    profile: CostProfile, context_length: int, path: Path, k_max: int = 16, w_max: int = 8
) -> None:
    grid = slowdown_grid(profile, context_length, k_max, w_max)
    figure, axes = plt.subplots(figsize=(1 + 0.55 * k_max, 1 + 0.5 * w_max))
    image = axes.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
    for w, row in enumerate(grid):
        for k, value in enumerate(row):
            axes.text(k, w, f"{value:.1f}", ha="center", va="center", fontsize=7, color="white")
    axes.set_xticks(range(k_max), [str(k) for k in range(1, k_max + 1)])
    axes.set_yticks(range(w_max), [str(w) for w in range(1, w_max + 1)])
    axes.set_xlabel("k (speculations)")
    axes.set_ylabel("w (tokens per speculation)")
    axes.set_title(
        f"pass slowdown vs 1 token, L={context_length}\n{profile.device}, {profile.dtype}"
    )
    figure.colorbar(image, ax=axes, label="× cost of one token")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
