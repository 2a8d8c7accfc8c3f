import pytest
import torch

from tearless.flow.tasks import Points2D, Shapes, image_grid, load_reward_fn, make_task
from tests.tolerances import sum_tol


def draw(size, top, left, h, w):
    img = -torch.ones(1, size, size)
    img[0, top : top + h, left : left + w] = 1.0
    return img


def test_shapes_reward_hand_cases():
    task = Shapes(8)
    names = task.prompt_names()
    square2, square3, bar = names.index("square2"), names.index("square3"), names.index("bar1x4")
    left_square = draw(8, 2, 0, 2, 2)  # columns 0-1: centroid 0.5 < 3.5
    right_square = draw(8, 5, 6, 2, 2)  # columns 6-7
    stray = left_square.clone()
    stray[0, 7, 7] = 1.0  # one lit pixel far away: the bounding box is no longer 2×2
    missing = draw(8, 0, 0, 3, 3)
    missing[0, 1, 1] = -1.0  # a 3×3 square with one pixel off: count 8 is within one of 9
    straddling = draw(8, 4, 1, 1, 4)  # columns 1-4: three of its four lit pixels in the left half
    samples = torch.stack([left_square, right_square, stray, left_square, missing, straddling])
    ids = torch.tensor([square2, square2, square2, bar, square3, bar])
    assert task.reward(samples, ids).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0, 0.75]
    m = task.metrics(samples, ids)
    assert m["shape_ok"] == pytest.approx(4 / 6) and m["left_ok"] == pytest.approx(5 / 6)
    assert m["strict"] == pytest.approx(3 / 6)  # the requested shape with its centroid on the left
    assert m["reward"] == pytest.approx(2.75 / 6)


@pytest.mark.parametrize("size", [8, 16])
def test_shapes_data_always_draw_the_requested_shape(size):
    task = Shapes(size)
    ids = torch.arange(task.num_prompts).repeat(100)
    data = task.data(ids, torch.Generator().manual_seed(0))
    assert data.shape == (len(ids), 1, size, size)
    m = task.metrics(data, ids)
    assert m["shape_ok"] == 1.0
    # Positions are uniform: well under half the shapes sit left of the centre (centred ones do not).
    assert 0.3 < m["left_ok"] < 0.5


def test_points2d_reward_and_metrics():
    task = Points2D()
    ids = torch.arange(4).repeat_interleave(500)
    centres = task.centres(ids)
    # class 1, mode 0 sits at angle π/8 on the radius-2 ring
    assert centres[500, 0].tolist() == pytest.approx([2 * 0.9238795, 2 * 0.3826834], abs=1e-5)
    assert task.reward(centres[:, 0], ids).tolist() == pytest.approx([1.0] * 2000)
    # The next mode is 2·√2 away: reward exp(−8/(2·0.16)) = exp(−25). The exponent comes from float32
    # cos/sin of the modes' angles (vectorised kernels differ by an ulp between instruction sets),
    # differenced, squared, summed and scaled: about 8 roundings of numbers of its own size; exp
    # turns the exponent's absolute error (25 times its relative one) into a relative error.
    rel = 25 * sum_tol(8, 1.0)
    want = torch.exp(torch.tensor(-25.0)).item()
    assert task.reward(centres[:1, 1], ids[:1]).item() == pytest.approx(want, rel=rel)
    data = task.data(ids, torch.Generator().manual_seed(0))
    m = task.metrics(data, ids)
    assert m["on_mode"] > 0.99 and 0.2 < m["target_hit"] < 0.3


def test_make_task_and_reward_loading(tmp_path):
    with pytest.raises(ValueError, match="known: points2d, shapes"):
        make_task("mnist")
    with pytest.raises(ValueError, match="image_size"):
        Shapes(12)
    f = tmp_path / "my_reward.py"
    f.write_text("def brightness(samples, prompt_ids):\n    return samples.flatten(1).mean(-1)\n")
    fn = load_reward_fn(f"{f}:brightness")
    assert fn(torch.ones(2, 1, 8, 8), torch.zeros(2)).tolist() == [1.0, 1.0]
    assert load_reward_fn("tearless.flow.tasks:make_task") is make_task
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("nothing")
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_reward_fn(f"{f}:nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/missing.py:f")


def test_image_grid_writes_a_png(tmp_path):
    from PIL import Image

    task = Shapes(8)
    rows = [task.to_images(torch.ones(3, 1, 8, 8)), task.to_images(-torch.ones(2, 1, 8, 8))]
    path = image_grid(rows, tmp_path / "g.png", upscale=2, gap=1)
    img = Image.open(path)
    assert img.size == ((3 * 9 - 1) * 2, (2 * 9 - 1) * 2)
    assert img.getpixel((0, 0)) == 255 and img.getpixel((0, 20)) == 0 and img.getpixel((16, 0)) == 89
    rgb = torch.zeros(1, 3, 4, 4)
    rgb[:, 0] = 1.0  # red
    assert Image.open(image_grid([rgb], tmp_path / "c.png", upscale=1)).getpixel((0, 0)) == (255, 0, 0)
