"""The Llama decoder (no parallelism inside) and its layout-independent initialisation."""

from meshlm.model.init import count_parameters, init_weights, initial_value
from meshlm.model.llama import Llama

__all__ = ["Llama", "count_parameters", "init_weights", "initial_value"]
