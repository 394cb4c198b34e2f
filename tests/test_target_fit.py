"""The creation check's judgement of a target table that already exists (``libs.target_fit``)."""

from __future__ import annotations

from contracts.events.rows import ColumnV1, TableMetaV1
from libs.target_fit import TargetColumn, TargetDefinition, fit_problems, narrower

META = TableMetaV1(columns=[
    ColumnV1(name="id", kind="int", sql_type="int(10) unsigned", nullable=False),
    ColumnV1(name="code", kind="string", sql_type="varchar(20)", nullable=False),
    ColumnV1(name="price", kind="decimal", sql_type="decimal(10,2)"),
    ColumnV1(name="state", kind="string", sql_type="enum('new','paid')")],
    primary_key=["id"], unique_keys=[["code"]])


def _target(types: dict[str, str], *uniques: tuple[str, ...]) -> TargetDefinition:
    return TargetDefinition(tuple(TargetColumn(n, t) for n, t in types.items()), tuple(uniques))


def test_a_wider_target_with_extra_columns_and_keys_with_more_columns_fits() -> None:
    mysql = _target({"ID": "bigint(20)", "code": "varchar(64)", "price": "decimal(14,4)",
                     "state": "enum('new','paid','gone')", "note": "text"}, ("id",), ("code", "id"))
    assert fit_problems(META, ("id",), mysql, "mysql") == []
    pg = _target({"id": "bigint", "code": "text", "price": "numeric(12,2)", "state": "text"}, ("id",))
    assert fit_problems(META, ("id",), pg, "postgresql") == []


def test_missing_narrower_and_foreign_columns_are_named_with_the_reason() -> None:
    target = _target({"id": "int(11)", "code": "varchar(10)", "price": "decimal(10,1)"}, ("id",))
    problems = fit_problems(META, ("id",), target, "mysql")
    assert problems == [
        "column id: int(11) is narrower than int(10) unsigned",
        "column code: varchar(10) is narrower than varchar(20)",
        "column price: decimal(10,1) keeps fewer fractional digits than decimal(10,2)",
        "column state: missing in the existing target",
    ]
    assert narrower("integer", "bigint") == "integer is narrower than bigint"
    assert narrower("date", "varchar(3)") == "date cannot hold varchar(3) values"
    assert narrower("enum('new')", "enum('new','paid')") == "members ['paid'] are missing"


def test_a_unique_key_the_merge_would_break_is_refused() -> None:
    origin = TableMetaV1(columns=[ColumnV1(name="_sluice_origin", kind="string", sql_type="varchar(255)",
                                           nullable=False), *META.columns],
                         primary_key=["_sluice_origin", "id"], unique_keys=[["_sluice_origin", "code"]])
    target = _target({c.name: c.sql_type for c in origin.columns}, ("_sluice_origin", "id"), ("code",))
    [problem] = fit_problems(origin, ("_sluice_origin", "id"), target, "mysql")
    assert problem.startswith("unique key (code): not a key of the source table")


def test_sqlite_only_needs_the_columns() -> None:
    target = _target({"id": "INTEGER", "code": "INTEGER", "price": "TEXT"}, ("id",))
    assert fit_problems(META, ("id",), target, "sqlite") == ["column state: missing in the existing target"]


def test_a_postgis_geometry_column_holds_a_spatial_source_column() -> None:
    meta = TableMetaV1(columns=[
        ColumnV1(name="id", kind="int", sql_type="int(11)", nullable=False),
        ColumnV1(name="p", kind="geometry", sql_type="point srid 4326"),
        ColumnV1(name="g", kind="geometry", sql_type="geometry")], primary_key=["id"])
    fits = _target({"id": "integer", "p": "geometry(Point,4326)", "g": "geometry"}, ("id",))
    assert fit_problems(meta, ("id",), fits, "postgresql") == []
    also = _target({"id": "integer", "p": "geometry", "g": "bytea"}, ("id",))
    assert fit_problems(meta, ("id",), also, "postgresql") == []
    narrow = _target({"id": "integer", "p": "geometry(Point,4326)", "g": "geometry(Polygon)"}, ("id",))
    assert fit_problems(meta, ("id",), narrow, "postgresql") == [
        "column g: geometry(Polygon) holds only polygon values, not every geometry"]
    other_srid = _target({"id": "integer", "p": "geometry(Point,3857)", "g": "geometry(Geometry,4326)"},
                         ("id",))
    assert fit_problems(meta, ("id",), other_srid, "postgresql") == [
        "column p: geometry(Point,3857) takes only SRID 3857 values (PostGIS enforces it), the source "
        "column declares SRID 4326",
        "column g: geometry(Geometry,4326) takes only SRID 4326 values (PostGIS enforces it), the "
        "source column declares no SRID"]
