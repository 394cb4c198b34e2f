"""The foreign-key schema the cascade tests share: a three-level CASCADE chain
(customers → orders → items), a SET NULL child (notes) and a self-referencing tree."""

CASCADE_SCHEMA = (
    "CREATE TABLE customers (id INT PRIMARY KEY, name VARCHAR(20))",
    "CREATE TABLE orders (id INT PRIMARY KEY, customer INT, FOREIGN KEY (customer) REFERENCES"
    " customers (id) ON DELETE CASCADE ON UPDATE CASCADE)",
    "CREATE TABLE items (id INT PRIMARY KEY, order_id INT NOT NULL, FOREIGN KEY (order_id)"
    " REFERENCES orders (id) ON DELETE CASCADE ON UPDATE CASCADE)",
    "CREATE TABLE notes (id INT PRIMARY KEY, order_id INT, FOREIGN KEY (order_id) REFERENCES"
    " orders (id) ON DELETE SET NULL ON UPDATE SET NULL)",
    "CREATE TABLE tree (id INT PRIMARY KEY, up INT, FOREIGN KEY (up) REFERENCES tree (id)"
    " ON DELETE CASCADE ON UPDATE CASCADE)",
)
CASCADE_TABLES = ("customers", "orders", "items", "notes", "tree")
