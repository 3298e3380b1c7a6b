"""Output names (merging/_keys.py): wrapper cleanup, the shared top key, and name filters."""

from __future__ import annotations

import pytest

from fsdpckpt.merging._keys import WRAPPER_SEGMENTS, clean_key, output_name, select, shares_top_key


@pytest.mark.parametrize("wrapper", WRAPPER_SEGMENTS)
def test_clean_key_drops_each_wrapper_segment_at_any_depth(wrapper):
    assert clean_key(f"{wrapper}.layers.0.{wrapper}.mlp.{wrapper}.weight") == \
        "layers.0.mlp.weight"


def test_clean_key_drops_repeated_wrappers():
    assert clean_key("a._fsdp_wrapped_module._fsdp_wrapped_module.b") == "a.b"


def test_clean_key_keeps_segments_that_only_contain_a_wrapper_name():
    assert clean_key("x_orig_mod.b") == "x_orig_mod.b"
    assert clean_key("a._orig_mod_x.b") == "a._orig_mod_x.b"
    assert clean_key("a.my_fsdp_wrapped_module") == "a.my_fsdp_wrapped_module"


def test_clean_key_of_a_name_that_is_only_a_wrapper_is_empty():
    assert clean_key("_orig_mod") == ""


def test_clean_key_leaves_a_clean_name_alone():
    assert clean_key("model.embed.weight") == "model.embed.weight"


def test_shares_top_key_when_every_entry_sits_under_one_key():
    assert shares_top_key([("model", "a"), ("model", "b", 0)])


def test_shares_top_key_is_false_for_two_top_keys():
    assert not shares_top_key([("model", "a"), ("optimizer", "b")])


def test_shares_top_key_is_false_when_an_entry_is_the_top_key_itself():
    # Dropping "model" would leave that entry with no name.
    assert not shares_top_key([("model", "a"), ("model",)])


def test_shares_top_key_is_false_for_no_entries():
    assert not shares_top_key([])


def test_output_name_joins_the_key_path_with_dots():
    assert output_name(("state", 0, "exp_avg"), strip_top=False) == "state.0.exp_avg"


def test_output_name_strips_the_top_key_and_wrappers():
    assert output_name(("model", "_orig_mod", "w"), strip_top=True) == "w"


def test_output_name_keeps_wrappers_without_clean():
    assert output_name(("model", "_orig_mod", "w"), strip_top=False, clean=False) == \
        "model._orig_mod.w"


def test_select_passes_everything_without_filters():
    assert select("anything")


def test_select_needs_one_matching_include():
    assert select("a.weight", include=["b.*", "a.*"])
    assert not select("c.weight", include=["b.*", "a.*"])


def test_select_exclude_wins_over_include():
    assert not select("a.bias", include=["a.*"], exclude=["*.bias"])


def test_select_globs_are_case_sensitive():
    assert not select("A.weight", include=["a.*"])


def test_select_takes_any_iterable_once():
    assert select("a.b", include=iter(["a.*"]), exclude=iter(["x"]))
