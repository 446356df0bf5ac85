"""Hardware profiles: the bundled TOMLs load, and bad files name file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_client.codecs import CODECS
from hw_profiles import (
    FIELDS,
    PYTHON_FLOOR,
    ProfileError,
    list_profiles,
    load_profile,
    profile_dir,
)

REQUIRED = {
    "raspberry-pi-zero-2w": 6, "raspberry-pi-4": 8, "raspberry-pi-5": 8,
    "jetson-nano": 16, "jetson-orin-nano": 32, "desktop": 32,
}


def test_bundled_profiles_have_the_required_bitwidths() -> None:
    profiles = {p.name: p for p in list_profiles()}
    for name, bits in REQUIRED.items():
        assert profiles[name].compute_bits == bits
        assert profiles[name].is_integer == (bits != 32)
    for p in profiles.values():
        assert (profile_dir() / f"{p.name}.toml").is_file(), "file name must equal the profile name"


def test_integer_profiles_train_on_the_board_s_cores() -> None:
    cores = {"raspberry-pi-zero-2w": 4, "raspberry-pi-4": 4, "raspberry-pi-5": 4,
             "jetson-nano": 4, "jetson-orin-nano-int8": 6, "jetson-orin-nano": 1,
             "desktop": 1}  # float devices: torch
    assert {p.name: p.threads for p in list_profiles()} == cores


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_profiles_read_the_codec_table(tmp_path: Path, codec: str) -> None:
    """Every registered codec, at the ends of its range, is a valid uplink of an Int8
    profile unless the codec itself says why not; one bit outside the range is refused."""
    c = CODECS[codec]
    lo, hi = c.bits_range
    for bits in (lo, hi):
        path = _write(tmp_path, codec=f'"{codec}"', codec_bits=str(bits))
        if c.bits_problem(bits, 8) is None:
            assert (load_profile(path).codec, load_profile(path).codec_bits) == (codec, bits)
        else:
            with pytest.raises(ProfileError, match="'codec_bits'"):
                load_profile(path)
    for bits in (lo - 1, hi + 1):
        with pytest.raises(ProfileError, match=f"'codec_bits' = {bits} out of range {lo}..{hi}"):
            load_profile(_write(tmp_path, codec=f'"{codec}"', codec_bits=str(bits)))
    float_device = _write(tmp_path, compute_bits="32", trainer='"torch"', codec=f'"{codec}"', codec_bits=str(hi))
    if c.integer_only:
        with pytest.raises(ProfileError, match="needs an integer device"):
            load_profile(float_device)
    else:
        assert load_profile(float_device).codec == codec


def _write(tmp_path: Path, **changes) -> Path:
    text = (profile_dir() / "raspberry-pi-4.toml").read_text()
    lines = [ln for ln in text.splitlines() if not any(ln.startswith(f"{k} ") for k in changes)]
    for k, v in changes.items():
        if v is not None:
            lines.append(f"{k} = {v}")
    path = tmp_path / "board.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    "changes,key",
    [
        ({"colour": '"red"'}, "colour"),
        ({"compute_bits": "7.5"}, "compute_bits"),
        ({"compute_bits": "24"}, "compute_bits"),
        ({"compute_bits": "32"}, "trainer"),
        ({"trainer": '"tensorflow"'}, "trainer"),
        ({"codec": '"zip"'}, "codec"),
        ({"codec": '"asym"', "codec_bits": "20"}, "codec_bits"),
        ({"codec_bits": "6"}, "codec_bits"),
        ({"ram_mb": "-1"}, "ram_mb"),
        ({"ram_mb": '"4GB"'}, "ram_mb"),
        ({"uplink_kbps": "0"}, "uplink_kbps"),
        ({"loss_rate": "1.5"}, "loss_rate"),
        ({"latency_ms": "nan"}, "latency_ms"),
        ({"relative_speed": "true"}, "relative_speed"),
        ({"name": '"a b"'}, "name"),
        ({"arch": None}, "arch"),
        ({"threads": "0"}, "threads"),
        ({"threads": "2.5"}, "threads"),
        ({"threads": "1000"}, "threads"),
        ({"python": '"3.8"'}, "python"),
        ({"python": "3.9"}, "python"),
        ({"python": '"3"'}, "python"),
        ({"python": '"3.x"'}, "python"),
        ({"image": "11"}, "image"),
    ],
)
def test_bad_profiles_name_file_and_key(tmp_path: Path, changes, key) -> None:
    path = _write(tmp_path, **changes)
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert str(path) in str(err.value)
    assert repr(key) in str(err.value), str(err.value)


def test_valid_custom_profile_loads(tmp_path: Path) -> None:
    p = load_profile(_write(tmp_path, name='"my-board"', uplink_kbps="1200"))
    assert p.name == "my-board" and p.uplink_kbps == 1200.0 and isinstance(p.uplink_kbps, float)
    assert set(FIELDS) == set(vars(p))


def test_bad_toml_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ProfileError, match="bad.toml: invalid TOML"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="missing.toml: cannot read"):
        load_profile(tmp_path / "missing.toml")
    with pytest.raises(ProfileError, match="unknown profile 'raspberry-pi-9'.*raspberry-pi-4"):
        load_profile("raspberry-pi-9")


def test_int_codec_sends_the_storage_grid(tmp_path: Path) -> None:
    """An Int6 device keeps its weights on the 8-bit grid: its `int` uplink is 8 bits."""
    assert load_profile("raspberry-pi-zero-2w").codec_bits == 8
    path = _write(tmp_path, compute_bits="6", codec_bits="6")
    with pytest.raises(ProfileError, match="'codec_bits' = 6 must be the storage grid"):
        load_profile(path)
    assert load_profile(_write(tmp_path, compute_bits="16", codec_bits="16")).codec_bits == 16


def test_profiles_say_what_image_and_python_they_assume(tmp_path: Path) -> None:
    """Each bundled profile names its OS image and that image's oldest Python (what
    `fedbit-edge doctor` requires); a custom profile without them gets the device floor."""
    for p in list_profiles():
        text = (profile_dir() / f"{p.name}.toml").read_text()
        assert "\nimage = " in text and "\npython = " in text, p.name
        assert p.image and p.python_floor >= PYTHON_FLOOR, p
    assert load_profile("raspberry-pi-4").python == "3.9"  # bullseye
    assert load_profile("raspberry-pi-5").python == "3.11"  # bookworm only
    assert "JetPack 4 ships Python 3.6: not supported" in load_profile("jetson-nano").image
    bare = load_profile(_write(tmp_path, image=None, python=None))
    assert (bare.image, bare.python, bare.python_floor) == ("", "3.9", (3, 9))
    assert load_profile(_write(tmp_path, python='"3.10"')).python_floor == (3, 10)
    with pytest.raises(ProfileError, match="needs Python >= 3.9"):
        load_profile(_write(tmp_path, python='"3.6"'))
