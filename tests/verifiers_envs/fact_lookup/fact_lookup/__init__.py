from fact_lookup.taskset import FactLookupTaskset

__all__ = ["FactLookupTaskset"]
