"""The pure parts of "keys known before the first change that depends on them" (DESIGN.md,
"Foreign-key cascades"): which DDL may change the key graph, the parents it names, whether a
span's tables are still one span under the keys read after it, and where a span new to its
tables starts. Process-tested end to end in tests/test_fk_cascades_process.py."""

from __future__ import annotations

from libs.foreign_keys import ForeignKey, ddl_may_change_keys, referenced_tables, regrouped
from libs.scheduling.model import Span, kv_parts
from services.sink_worker.span.checkpoints import Checkpoint
from services.sink_worker.span.start import inherited_start


def _fk(child: str, parent: str, on_delete: str = "CASCADE") -> ForeignKey:
    return ForeignKey("db", child, f"fk_{child}_{parent}", ("p_id",), "db", parent, ("id",), on_delete)


def _all(_database: str, _table: str) -> bool:
    return True


def test_statements_that_may_change_the_key_graph_are_told_by_their_text() -> None:
    for statement in ("CREATE TABLE c (id INT PRIMARY KEY)",
                      "create or replace table c (id int)",
                      "ALTER TABLE c ADD CONSTRAINT f FOREIGN KEY (p) REFERENCES p (id) ON DELETE CASCADE",
                      "ALTER TABLE c DROP FOREIGN KEY f",
                      "RENAME TABLE p TO p2",
                      "ALTER TABLE c ADD COLUMN p2 INT REFERENCES p (id)"):
        assert ddl_may_change_keys(statement), statement
    for statement in ("ALTER TABLE c ADD COLUMN note VARCHAR(10)", "TRUNCATE TABLE c",
                      "DROP TABLE c", "CREATE INDEX i ON c (p)"):
        assert not ddl_may_change_keys(statement), statement


def test_the_parents_a_statement_names_after_references_default_to_the_childs_database() -> None:
    statement = ("CREATE TABLE c (id INT, a INT, b INT, d INT,"
                 " FOREIGN KEY (a) REFERENCES p (id) ON DELETE CASCADE,"
                 " FOREIGN KEY (b) REFERENCES `other`.`we``ird` (id),"
                 " FOREIGN KEY (d) references p(id) ON UPDATE SET NULL)")
    assert referenced_tables(statement, "db") == [("db", "p"), ("other", "we`ird")]
    assert referenced_tables("ALTER TABLE c DROP FOREIGN KEY f", "db") == []


def test_a_span_passes_a_key_change_only_when_its_tables_stay_exactly_one_span() -> None:
    keys = [_fk("c", "p")]
    assert regrouped([("db", "x")], keys, _all) is None  # untouched
    assert regrouped([("db", "p"), ("db", "c")], keys, _all) is None  # the group as it is
    # a key added: the table spans of both ends are now one group
    assert regrouped([("db", "c")], keys, _all) == (("db", "c"), ("db", "p"))
    assert regrouped([("db", "p")], keys, _all) == (("db", "c"), ("db", "p"))
    # a group grown by a grandchild
    grown = [*keys, _fk("gc", "c")]
    assert regrouped([("db", "c"), ("db", "p")], grown, _all) == (("db", "c"), ("db", "gc"), ("db", "p"))
    # a key dropped: the group falls apart into its tables
    assert regrouped([("db", "c"), ("db", "p")], [], _all) == (("db", "c"), ("db", "p"))
    # a key that cascades nothing, or with an end the filter leaves out, connects nothing
    assert regrouped([("db", "c")], [_fk("c", "p", on_delete="RESTRICT")], _all) is None
    assert regrouped([("db", "c")], keys, lambda _d, t: t != "p") is None


def test_a_span_new_to_its_tables_starts_at_the_lowest_checkpoint_of_those_that_held_them() -> None:
    p, c, gc = ("db", "p"), ("db", "c"), ("db", "gc")
    group, child = ((p, c), Checkpoint(40, 400)), ((gc,), Checkpoint(35, 500))
    unrelated = ((("db", "x"),), Checkpoint(1, 1))
    # a group grown by a table: the old group's and the new member's, lowest in each field
    assert inherited_start({p, c, gc}, [group, child, unrelated]) == (Checkpoint(35, 400), True)
    # a group split: each table goes on from the group's
    assert inherited_start({p}, [group, unrelated]) == (Checkpoint(40, 400), True)
    # a table nobody held: not covered (the caller decides where such a table starts)
    assert inherited_start({p, c, gc}, [group]) == (Checkpoint(40, 400), False)
    assert inherited_start({gc}, [group, unrelated]) == (None, False)


def test_a_checkpoint_key_gives_its_span_back() -> None:
    span = Span("cf.1", "src", "d b", "fk~db:c+db:p")
    assert Span(*kv_parts(span.kv_key)) == span
    assert Span(*kv_parts(span.kv_key)).members == (("db", "c"), ("db", "p"))
