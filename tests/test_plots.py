"""The memory figures read without their data: a title on the figure and each panel, labelled
axes, and a line that another of equal values is drawn over still showing (normal's and
save_factors' after-forward memory are the same bytes)."""

import itertools

import pytest

from swiglu_train.bench.memory.stack import plot
from swiglu_train.memory.plots import plot_comparison
from swiglu_train.memory.runs import MemoryRun, layer_key


def check_readable(fig) -> None:
    assert fig.get_suptitle()
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), ax


def check_apart(lines) -> None:
    """Each line its own hollow marker; of two lines, the one drawn first has the wider line
    and the larger marker, so it shows around the one drawn over it."""
    assert len({line.get_marker() for line in lines}) == len(lines)
    assert all(line.get_markerfacecolor() == "none" for line in lines)
    for first, later in itertools.combinations(lines, 2):
        assert first.get_linewidth() > later.get_linewidth()
        assert first.get_markersize() > later.get_markersize()


def stack_rows(cuda: bool) -> list[dict]:
    mib = {"normal": 990.6, "save_factors": 990.6, "drop_h": 686.1}  # the first two coincide
    return [
        {
            "impl": impl,
            "layers": layers,
            "saved_for_backward_bytes": int(per_layer * layers * 2**20),
            "after_forward_MiB": per_layer * layers if cuda else None,
            "peak_MiB": 2 * per_layer * layers if cuda else None,
        }
        for impl, per_layer in mib.items()
        for layers in (1, 2, 4)
    ]


@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "cpu"])
def test_bench_memory_s_figure_keeps_equal_impls_apart(cuda):
    fig = plot(stack_rows(cuda))
    check_readable(fig)
    assert len(fig.axes) == (2 if cuda else 1)
    for ax in fig.axes:
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == ["normal", "save_factors", "drop_h"]
        assert list(lines[0].get_ydata()) == list(lines[1].get_ydata())  # drawn over each other
        check_apart(lines)


def run(label: str, steps: int) -> MemoryRun:
    series = {"memory/saved_MiB": [10.0] * steps}
    for layer in range(3):
        series[layer_key(layer, "cumulative_saved_MiB")] = [3.0 * (layer + 1)] * steps
        series[layer_key(layer, "saved_MiB")] = [3.0] * steps
    return MemoryRun(label, {"mlp_impl": label}, list(range(steps)), series)


def test_compare_memory_s_figure_keeps_equal_runs_apart():
    fig = plot_comparison([run("normal", 40), run("save_factors", 40)])
    check_readable(fig)
    per_step, depth, _ = fig.axes
    for ax in (per_step, depth):
        lines = ax.get_lines()
        assert [list(line.get_ydata()) for line in lines[:1]] == [list(lines[1].get_ydata())]
        check_apart(lines)
    first, later = (line.get_markevery() for line in per_step.get_lines())
    assert first != later  # staggered: the markers of equal series do not coincide


def test_result_plots_are_written_as_palette_pngs_of_the_figure_s_size_and_colours(tmp_path):
    """Committed result plots take a third of their RGBA bytes (every device call carries the
    tree in 64 MiB beside the wheels), yet keep the figure's size and its line colours."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    from swiglu_train.files import png_bytes, write_png_atomic

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(range(10), [v * v for v in range(10)], color="#d62728", linewidth=6)
    ax.set(title="t", xlabel="x", ylabel="y")
    plain = io.BytesIO()
    fig.savefig(plain, format="png", dpi=100)
    write_png_atomic(tmp_path / "p.png", fig, dpi=100)
    plt.close(fig)
    data = (tmp_path / "p.png").read_bytes()
    assert data == png_bytes(fig, dpi=100)  # rendered the same way twice: deterministic
    image = Image.open(io.BytesIO(data))
    assert image.mode == "P" and image.size == (400, 300)
    assert len(data) < len(plain.getvalue()) / 2
    colours = {rgb for _, rgb in image.convert("RGB").getcolors(256)}
    assert min(sum(abs(a - b) for a, b in zip(c, (214, 39, 40), strict=True)) for c in colours) <= 6
    assert not list(tmp_path.glob(".p.png.*"))  # no temporary left beside it
