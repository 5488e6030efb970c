"""Includes: resolved relative to the including file, confined to the root, once each, no cycles."""

import pytest

from remapdsl import RemapError, load_rules


def write(folder, name, text):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def codes(exc):
    return [d.code for d in exc.value.diagnostics]


def test_included_statements_are_inserted_in_place(tmp_path):
    write(tmp_path, "common/norms.remap", "remap 1\nlet H = config.hidden_size\nmodel.norm.weight -> norm.weight\n")
    top = write(tmp_path, "model.remap", 'remap 1\ninclude "common/norms.remap"\nx.w -> y.w | reshape([H, -1])\n')
    rules = load_rules(top)
    assert [type(s).__name__ for s in rules.statements] == ["Version", "Let", "Rule", "Rule"]
    assert [f.path for f in rules.files] == [str(top), str(tmp_path / "common/norms.remap")]
    assert rules.statements[2].span.path.endswith("norms.remap")


def test_cycle_is_an_error(tmp_path):
    write(tmp_path, "a.remap", 'include "b.remap"\n')
    write(tmp_path, "b.remap", 'include "a.remap"\n')
    with pytest.raises(RemapError) as info:
        load_rules(tmp_path / "a.remap")
    assert codes(info) == ["E140"]
    assert "a.remap -> b.remap -> a.remap" in info.value.diagnostic.message


def test_missing_file(tmp_path):
    top = write(tmp_path, "a.remap", 'include "nowhere.remap"\n')
    with pytest.raises(RemapError) as info:
        load_rules(top)
    assert codes(info) == ["E141"]
    assert info.value.diagnostic.span.line == 1


def test_escaping_the_root_is_refused_without_reading(tmp_path):
    secret = write(tmp_path, "secret.remap", "let SECRET = 42\n")
    top = write(tmp_path, "rules/a.remap", 'include "../secret.remap"\n')
    with pytest.raises(RemapError) as info:
        load_rules(top)
    assert codes(info) == ["E142"]
    assert "SECRET" not in str(info.value)
    assert load_rules(top, root=tmp_path).statements[0].name == "SECRET"
    assert secret.exists()


def test_a_file_included_twice_is_an_error(tmp_path):
    write(tmp_path, "c.remap", "let C = 1\n")
    top = write(tmp_path, "a.remap", 'include "c.remap"\ninclude "c.remap"\n')
    with pytest.raises(RemapError) as info:
        load_rules(top)
    assert codes(info) == ["E143"]


def test_version_must_agree(tmp_path):
    write(tmp_path, "c.remap", "remap 1\nlet C = 1\n")
    top = write(tmp_path, "a.remap", 'remap 1\ninclude "c.remap"\n')
    assert len(load_rules(top).statements) == 2


def test_static_checks_see_across_files(tmp_path):
    write(tmp_path, "lets.remap", "let H = 4\n")
    top = write(tmp_path, "a.remap", 'include "lets.remap"\nlet H = 5\n')
    with pytest.raises(RemapError) as info:
        load_rules(top)
    assert codes(info) == ["E131"]
    assert "lets.remap:1:1" in info.value.diagnostic.message


def test_syntax_error_in_included_file_names_that_file(tmp_path):
    write(tmp_path, "bad.remap", "a.b c.d\n")
    top = write(tmp_path, "a.remap", 'include "bad.remap"\n')
    with pytest.raises(RemapError) as info:
        load_rules(top)
    assert info.value.diagnostic.span.path.endswith("bad.remap")


def test_includes_nest_at_most_16_files_deep(tmp_path):
    for depth in range(1, 18):
        write(tmp_path, f"d{depth}.remap", f'include "d{depth + 1}.remap"\n' if depth < 17 else "a -> b\n")
    top = write(tmp_path, "top.remap", 'include "d1.remap"\n')
    with pytest.raises(RemapError) as info:
        load_rules(top)
    assert codes(info) == ["E145"]
    assert info.value.diagnostic.span.path.endswith("d16.remap")  # d17 would be 17 deep
    write(tmp_path, "d16.remap", "a -> b\n")
    assert len(load_rules(top).files) == 17  # the top and 16 levels below it
