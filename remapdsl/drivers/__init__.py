"""The entry points' drivers: each prepares (rules, headers, compile, agreement), plans, and hands
the plans to the executors of remapdsl.runtime; `Prepared` keeps what was prepared for the next call.
They import torch at module level: the api imports them only when called, so `import remapdsl` stays free of it."""
