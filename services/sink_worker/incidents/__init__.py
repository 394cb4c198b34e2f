"""A table stopped: poison rows, DDL failures and the incidents log with operator actions."""
