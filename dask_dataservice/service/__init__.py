"""The data service on Dask: dispatcher state, journal, plugins and client."""
