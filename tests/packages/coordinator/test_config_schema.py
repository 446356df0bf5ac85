"""A config file's sections as dataclasses: their fields are the keys (types from the
annotations, defaults from the fields), a file loads each section as an instance read
by attribute, and a section's own check names the file and the key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from coordinator import job
from coordinator.config import NUMBER, TomlSchema, checked, section_keys, toml_types
from coordinator.emulation import config as experiment
from edge_client.errors import ConfigError


@dataclass
class Privacy:
    """A section as another engineer would add one: fields and a check."""

    epsilon: float = 8.0
    groups: list[str] = field(default_factory=list)
    noise: dict[str, float] = field(default_factory=dict)
    port: str = field(default="", metadata={"toml": (str, int)})
    owner: str = field(default="", metadata={"file": False})

    def check(self) -> None:
        if not self.epsilon > 0:
            raise ConfigError(f"epsilon: must be > 0, got {self.epsilon}")


def test_a_dataclass_s_fields_are_its_section_s_keys() -> None:
    assert toml_types(float) == NUMBER and toml_types(list[int]) is list and toml_types(str | int) == (str, int)
    keys = section_keys(Privacy)
    assert keys == {"epsilon": (NUMBER, 8.0), "groups": (list, []), "noise": (dict, {}),
                    "port": ((str, int), "")}  # owner: set by the program


def test_a_new_section_is_one_dataclass_and_one_entry() -> None:
    schema = TomlSchema.of({"": {"name": (str, "run")}, "privacy": Privacy})
    got = schema.load({"name": "x", "privacy": {"epsilon": 2, "groups": ["a"]}}, "f.toml")
    assert got["privacy"] == Privacy(epsilon=2.0, groups=["a"]) and got[""] == {"name": "x"}
    assert type(got["privacy"].epsilon) is float  # a float field holds a float, also from `epsilon = 2`
    assert schema.load({}, "f.toml")["privacy"] == Privacy()
    for raw, message in (({"privacy": {"epsilon": "big"}}, "f.toml: privacy.epsilon: expected int or float"),
                         ({"privacy": {"delta": 1}}, "f.toml: privacy.delta: unknown key"),
                         ({"privacy": {"owner": "me"}}, "f.toml: privacy.owner: unknown key"),
                         ({"privacy": 3}, "f.toml: privacy: expected a table")):
        with pytest.raises(ConfigError) as err:
            schema.load(raw, "f.toml")
        assert message in str(err.value)
    bad = schema.load({"privacy": {"epsilon": 0}}, "f.toml")["privacy"]
    with pytest.raises(ConfigError, match=r"^f\.toml: privacy\.epsilon: must be > 0, got 0\.0$"):
        checked(bad, "privacy", "f.toml")


@pytest.mark.parametrize("schema", [experiment.SCHEMA, job.SCHEMA], ids=["experiment", "job"])
def test_every_fixed_section_loads_as_its_dataclass(schema: TomlSchema) -> None:
    values = schema.load({"out": "x"} if schema is job.SCHEMA else {}, "f.toml")
    for name, cls in schema.classes.items():
        assert isinstance(values[name], cls)
        assert set(schema.sections[name]) == {f.name for f in dataclasses.fields(cls) if f.metadata.get("file", True)}
    assert set(schema.sections) - {""} <= set(schema.classes)  # every fixed section has its class


def test_the_experiment_s_sections_are_read_by_attribute() -> None:
    cfg = experiment.load_config(None, {"round.workers": 1, "data.alpha": 2})
    assert cfg.round.workers == 1 and cfg.data.alpha == 2 and cfg.cluster.backend == "local"
    assert cfg.as_dict()["round"]["workers"] == 1  # back to the table it came from
    assert experiment.from_dict(cfg.as_dict(), "again").round == cfg.round
