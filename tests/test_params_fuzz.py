"""Property tests of the params loader: whatever a hand edit or `dvc exp run -S` writes into a
section, loading it gives the typed section or a ParamsError naming the file and the key; never
a traceback of another kind."""
import math

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftlab.params import SECTIONS, ParamsError, load_params

DEFAULTS = yaml.safe_load(open("params.yaml"))

# Values of every kind YAML (and Hydra's -S parsing) can produce.
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
keys = st.sampled_from([(s, k) for s in DEFAULTS for k in DEFAULTS[s]])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=keys, value=values)
def test_any_value_in_any_key_loads_or_is_named(tmp_path, key, value):
    section, name = key
    data = {s: dict(v) for s, v in DEFAULTS.items()}
    data[section][name] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        loaded = getattr(load_params([section], path), section)
    except ParamsError as e:
        assert str(path) in str(e) and f"{section}.{name}" in str(e), str(e)
    else:
        assert isinstance(loaded, SECTIONS[section])
        got = getattr(loaded, name)
        for v in got if isinstance(got, list) else [got]:
            assert not isinstance(v, float) or math.isfinite(v), f"{section}.{name} = {v!r} was accepted"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(section=st.sampled_from(sorted(DEFAULTS)), junk=st.one_of(values, st.dictionaries(st.text(max_size=8), values, max_size=3)))
def test_a_whole_section_replaced_by_junk_is_named(tmp_path, section, junk):
    data = {s: dict(v) for s, v in DEFAULTS.items()}
    data[section] = junk
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        load_params([section], path)
    except ParamsError as e:
        assert str(path) in str(e) and section in str(e), str(e)
