"""Reading executed query plans (EXPLAIN (ANALYZE, FORMAT JSON))."""


def rows_read(plan: dict, table: str) -> float:
    """Rows the executed plan read from ``table``, over every loop."""
    read = 0.0
    if plan.get("Relation Name") == table:
        read += (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)) * plan["Actual Loops"]
    return read + sum(rows_read(child, table) for child in plan.get("Plans", ()))
