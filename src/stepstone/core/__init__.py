"""The pure core: plans, validation, hashing and the transition function.

Nothing here does I/O, touches asyncio or speaks SQL; the store and the runtime
feed it snapshots and carry out the decisions it returns.
"""
