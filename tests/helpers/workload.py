"""A seeded random workload on a MariaDB database: inserts, updates (including primary-key
changes and unique-key hand-overs), deletes, across tables that cover the column kinds."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable
from decimal import Decimal
from typing import Any

TABLES = {
    "accounts": (
        "CREATE TABLE {db}.accounts (id BIGINT PRIMARY KEY, email VARCHAR(64) NOT NULL,"
        " balance DECIMAL(14,2) NULL, note TEXT NULL, updated DATETIME(6) NULL,"
        " UNIQUE KEY uk_email (email)) CHARACTER SET utf8mb4"
    ),
    "events": (
        "CREATE TABLE {db}.events (id INT UNSIGNED PRIMARY KEY, kind ENUM('a','b','c') NULL,"
        " payload JSON NULL, raw BLOB NULL, seen TIMESTAMP(3) NULL, flags SET('x','y','z') NULL)"
    ),
    "select": (  # a table named like SQL, with columns named like SQL
        "CREATE TABLE {db}.`select` (`order` INT PRIMARY KEY, `from` VARCHAR(32) NULL,"
        " `group` BIGINT NULL) CHARACTER SET utf8mb4"
    ),
}

_NOTES = [None, "plain", "ünïcødé", "emoji 🚀🎉", "quote ' and \" and \\", ""]


class RandomWorkload:
    def __init__(self, conn: Any, database: str, seed: int) -> None:
        self.conn = conn
        self.db = database
        self.rng = random.Random(seed)
        self.ids: dict[str, list[int]] = {t: [] for t in TABLES}
        self.next_id = 1
        self.statements = 0

    def create_tables(self) -> None:
        with self.conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE IF NOT EXISTS `{self.db}`")
            for ddl in TABLES.values():
                cur.execute(ddl.format(db=f"`{self.db}`"))

    def _new_id(self) -> int:
        self.next_id += self.rng.randint(1, 3)
        return self.next_id

    def _insert(self, cur: Any, table: str) -> None:
        new = self._new_id()
        r = self.rng
        if table == "accounts":
            updated = f"2026-11-{r.randint(1, 28):02d} 12:34:56.{r.randint(0, 999999):06d}"
            cur.execute(f"INSERT INTO `{self.db}`.accounts VALUES (%s, %s, %s, %s, %s)",
                        (new, f"user{new}@example.com", Decimal(r.randint(-10**6, 10**6)) / 100,
                         r.choice(_NOTES), updated))
        elif table == "events":
            cur.execute(f"INSERT INTO `{self.db}`.events VALUES (%s, %s, %s, %s, %s, %s)",
                        (new, r.choice(["a", "b", "c", None]),
                         r.choice([None, json.dumps({"n": r.randint(0, 9), "s": "ü"}), "[1, 2]"]),
                         r.choice([None, bytes(r.randrange(256) for _ in range(r.randint(0, 40)))]),
                         r.choice([None, "2026-01-02 03:04:05.678"]), r.choice([None, "", "x", "x,z"])))
        else:
            cur.execute(f"INSERT INTO `{self.db}`.`select` VALUES (%s, %s, %s)",
                        (new, r.choice(["drop table", "'; --", None]), r.randint(-2**62, 2**62)))
        self.ids[table].append(new)

    def _update(self, cur: Any, table: str) -> None:
        ids = self.ids[table]
        old = self.rng.choice(ids)
        if self.rng.random() < 0.2:
            # Primary-key change: downstream must delete the old key and insert the new one.
            new = self._new_id()
            col = {"accounts": "id", "events": "id", "select": "`order`"}[table]
            tbl = "`select`" if table == "select" else table
            cur.execute(f"UPDATE `{self.db}`.{tbl} SET {col} = %s WHERE {col} = %s", (new, old))
            ids[ids.index(old)] = new
        elif table == "accounts":
            cur.execute(f"UPDATE `{self.db}`.accounts SET balance = balance + 1, note = %s WHERE id = %s",
                        (self.rng.choice(_NOTES), old))
        elif table == "events":
            cur.execute(f"UPDATE `{self.db}`.events SET kind = %s, flags = %s WHERE id = %s",
                        (self.rng.choice(["a", "b"]), self.rng.choice(["y", "x,y,z", None]), old))
        else:
            cur.execute(f"UPDATE `{self.db}`.`select` SET `group` = `group` DIV 2 WHERE `order` = %s", (old,))

    def _delete(self, cur: Any, table: str) -> None:
        ids = self.ids[table]
        victim = ids.pop(self.rng.randrange(len(ids)))
        col = "`order`" if table == "select" else "id"
        tbl = "`select`" if table == "select" else table
        cur.execute(f"DELETE FROM `{self.db}`.{tbl} WHERE {col} = %s", (victim,))

    def _hand_over_unique(self, cur: Any) -> None:
        """The TDSQL case: a unique value leaves one key and arrives at another, in two transactions."""
        ids = self.ids["accounts"]
        victim = ids.pop(self.rng.randrange(len(ids)))
        cur.execute(f"SELECT email FROM `{self.db}`.accounts WHERE id = %s", (victim,))
        (email,) = cur.fetchone()
        cur.execute(f"DELETE FROM `{self.db}`.accounts WHERE id = %s", (victim,))
        cur.execute("COMMIT")
        cur.execute("BEGIN")
        new = self._new_id()
        cur.execute(f"INSERT INTO `{self.db}`.accounts (id, email, balance) VALUES (%s, %s, 1.00)",
                    (new, email))
        ids.append(new)

    def transaction(self, size: int = 8) -> None:
        with self.conn.cursor() as cur:
            cur.execute("BEGIN")
            for _ in range(size):
                table = self.rng.choice(list(TABLES))
                roll = self.rng.random()
                if roll < 0.5 or len(self.ids[table]) < 5:
                    self._insert(cur, table)
                elif roll < 0.8:
                    self._update(cur, table)
                elif roll < 0.95:
                    self._delete(cur, table)
                else:
                    self._hand_over_unique(cur)
                self.statements += 1
            cur.execute("COMMIT")


def run_in_thread(workload: RandomWorkload, stop: threading.Event, txn_size: int = 8,
                  on_txn: Callable[[int], None] | None = None,
                  pause_s: float = 0.0) -> threading.Thread:
    """Run transactions until ``stop``; ``pause_s`` paces the load (it is not a synchronisation)."""

    def loop() -> None:
        n = 0
        while not stop.is_set():
            workload.transaction(txn_size)
            n += 1
            if on_txn is not None:
                on_txn(n)
            if pause_s:
                stop.wait(pause_s)

    thread = threading.Thread(target=loop, name=f"workload-{workload.db}", daemon=True)
    thread.start()
    return thread
