"""Unit tests: keys a downstream collation may compare as equal share an apply partition."""

from __future__ import annotations

from contracts import REGISTRY
from contracts.events.rows import RowImageV2, RowsChangedV2, TableMetaV1
from services.sink_worker.round.apply_job import explode_event
from services.sink_worker.round.key_buckets import fold_text, key_bucket


def test_fold_is_case_accent_and_pad_space_insensitive() -> None:
    assert fold_text("p2  ") == fold_text("p2") == "p2"
    assert fold_text("ABC") == fold_text("abc")
    assert fold_text("Émile ") == fold_text("emile")
    assert fold_text("STRASSE") == fold_text("straße")
    assert fold_text("😀") == "😀"
    assert fold_text(" lead") == " lead"  # leading spaces are significant under PAD SPACE too
    assert fold_text("a\t") != fold_text("a")  # PAD SPACE pads with spaces only


def test_bucket_is_equal_for_collation_equal_keys_and_spreads_others() -> None:
    assert key_bucket(["p2"]) == key_bucket(["P2  "])
    assert key_bucket([1, "Ab"]) == key_bucket([1, "aB "])
    assert key_bucket([1, "ab"]) != key_bucket([2, "ab"])
    buckets = {key_bucket([f"k{i}"]) % 8 for i in range(200)}
    assert len(buckets) == 8


def _event(rows: list[RowImageV2]) -> bytes:
    meta = TableMetaV1.model_validate({
        "columns": [{"name": "code", "kind": "string", "sql_type": "varchar(20)", "nullable": False},
                    {"name": "v", "kind": "int", "sql_type": "int"}],
        "primary_key": ["code"]})
    return REGISTRY.encode(RowsChangedV2.model_validate({
        "source": "s", "database": "d", "table": "t", "ts": 5, "seq": 0,
        "position": {"binlog_file": "b.1", "binlog_pos": 4}, "meta": meta.model_dump(),
        "rows": [r.model_dump() for r in rows]}), producer="test")


def test_both_halves_of_a_collation_equal_key_change_get_one_bucket() -> None:
    body = _event([
        RowImageV2(op="update", before={"code": "p2", "v": 1}, after={"code": "p2  ", "v": 1}),
        RowImageV2(op="update", before={"code": "a", "v": 1}, after={"code": "A", "v": 2})])
    recs = list(explode_event({"s": (0, ("code",), None)}, "s", 5, 1, 0, body))
    assert [(r[1], r[7]) for r in recs] == [('["p2"]', "delete"), ('["p2  "]', "upsert"),
                                           ('["a"]', "delete"), ('["A"]', "upsert")]
    assert recs[0][9] == recs[1][9] and recs[2][9] == recs[3][9]
    assert recs[3][8] == {"code": "A", "v": 2}
