"""Regenerate the figures of the docs (written to `docs/assets/`).

```bash
python docs/scripts/make_figures.py
```

- `nvfp4_format.png`: (a) the FP4 E2M1 grid with its codes and round-to-nearest
  boundaries; (b) the two scale levels on a real tensor: one float32 tensor scale and
  one E4M3 scale per block of 16, computed by `nvfp4x.to_nvfp4`.
"""

import os

import matplotlib

matplotlib.use("Agg")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import nvfp4x  # noqa: E402

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def grid_panel(ax) -> None:
    ax.axhline(0, color="0.6", lw=0.8, zorder=0)
    for code, mag in enumerate(E2M1):
        for sign, offset in ((1, 0), (-1, 8)):
            if mag == 0 and sign < 0:
                continue  # -0 (code 0x8) sits on top of +0
            v = sign * mag
            ax.plot(v, 0, "o", color="C0" if sign > 0 else "C3", ms=7, zorder=3)
            label = f"0x{code + offset:X}" if mag else "0x0\n0x8"
            ax.annotate(
                label,
                (v, 0),
                xytext=(0, 9),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7.5,
                family="monospace",
            )
            ax.annotate(
                f"{v:g}",
                (v, 0),
                xytext=(0, -11),
                textcoords="offset points",
                ha="center",
                va="top",
                fontsize=8,
            )
    mids = [(a + b) / 2 for a, b in zip(E2M1[:-1], E2M1[1:], strict=True)]
    for m in mids:
        for s in (1, -1):
            ax.plot([s * m, s * m], [-0.25, 0.25], color="0.45", lw=0.8, ls=":")
    for lo, hi, step in ((0, 2, 0.5), (2, 4, 1), (4, 6, 2)):
        ax.annotate(
            "", (lo, 0.62), (hi, 0.62), arrowprops=dict(arrowstyle="<->", color="0.3", lw=0.8)
        )
        ax.text((lo + hi) / 2, 0.68, f"step {step:g}", ha="center", va="bottom", fontsize=8)
    ax.set_xlim(-6.7, 6.7)
    ax.set_ylim(-0.7, 1.0)
    ax.set_yticks([])
    ax.set_xticks([])
    for side in ("left", "right", "top", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        "(a) FP4 E2M1 elements: 1 sign, 2 exponent, 1 mantissa bit (codes above, values below;\n"
        "dotted: round-to-nearest-even boundaries; values beyond ±6 saturate)",
        fontsize=9.5,
        loc="left",
    )


def scales_panel(ax) -> None:
    rng = np.random.default_rng(3)
    magnitudes = (0.02, 0.25, 1.0, 6.0)  # four blocks of 16, very different ranges
    x = np.concatenate([m * rng.standard_normal(16) for m in magnitudes]).astype(np.float32)
    q = nvfp4x.to_nvfp4(jnp.asarray(x))
    deq = np.asarray(q.dequantize())
    s_dec = float(q.tensor_scale)
    block_scales = np.asarray(q.scales.astype(jnp.float32))
    idx = np.arange(len(x))
    ax.semilogy(idx, np.abs(x), "o", ms=4.5, mfc="none", color="C0", label="|x| (float32)")
    ax.semilogy(idx, np.abs(deq), "x", ms=4.5, color="C3", label="|dequantised| (NVFP4)")
    for b, sb in enumerate(block_scales):
        lo, hi = 16 * b - 0.4, 16 * b + 15.4
        for v in E2M1[1:]:
            ax.plot([lo, hi], [v * sb * s_dec] * 2, color="0.75", lw=0.6, zorder=0)
        ax.axvline(16 * b - 0.5, color="0.5", lw=0.8, ls="--") if b else None
        ax.text(
            16 * b + 7.5,
            1.6 * 6 * sb * s_dec,
            f"block scale\n{sb:g} (E4M3)",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xlim(-1, len(x))
    ax.set_ylim(np.abs(x).min() / 3, 40 * np.abs(x).max())
    ax.set_xlabel("element (4 blocks of 16 along the last axis)")
    ax.set_ylabel("magnitude")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(
        "(b) Two scale levels: value = e2m1 × block scale (E4M3) × tensor scale (float32,\n"
        f"here {s_dec:.3g} = amax / 2688). Grey lines: the 7 non-zero magnitudes each block "
        "can represent;\nvalues below half the smallest flush to zero (not drawn on "
        "the log axis).",
        fontsize=9.5,
        loc="left",
    )


def main() -> None:
    os.makedirs(ASSETS, exist_ok=True)
    fig, (a, b) = plt.subplots(
        2, 1, figsize=(8.5, 7.6), dpi=110, gridspec_kw=dict(height_ratios=[1, 1.9])
    )
    grid_panel(a)
    scales_panel(b)
    fig.tight_layout()
    path = os.path.join(ASSETS, "nvfp4_format.png")
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
