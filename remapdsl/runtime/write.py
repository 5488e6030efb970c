"""A rank's WritePlan + its local tensors -> their bytes written at their offsets in the output files."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from ..checkpoint import CheckpointReader
from ..checkpoint.reader import as_byte_view
from ..errors import Diagnostic, RemapError
from ..indexmap import is_row_major
from ..sharding.plans import DecodeItem, WritePlan
from .pieces import apply_steps, read_part, region, torch_dtype


def run_write_plan(plan: WritePlan, writer, tensors: Mapping[str, torch.Tensor], threads: int = 2,
                   reader: CheckpointReader | None = None) -> None:
    """Write one rank's pieces on `threads` threads, value steps undone (dequantized ones encoded again)."""
    with torch.no_grad():
        work = [(item, region(tensors[item.runtime_key], item)) for item in (*plan.items, *plan.encodes)]

        def write(unit: tuple) -> None:
            item, view = unit
            if isinstance(item, DecodeItem):
                _write_encoded(item, view, writer, reader, plan.requantize)
                return
            dtype = torch_dtype(item.dtype)
            if (not item.steps and view.dtype == dtype and view.device.type == "cpu"
                    and view.is_contiguous() and is_row_major(item.strides, item.sizes)):  # straight from memory
                writer.write_runs(item.file, item.runs, as_byte_view(view))
                return
            staging = torch.empty(item.runs.total, dtype=torch.uint8)
            values = apply_steps(view.detach().cpu() if view.device.type != "cpu" else view, item.steps)
            staging.view(dtype).as_strided(item.sizes, item.strides).copy_(values)
            writer.write_runs(item.file, item.runs, memoryview(staging.numpy()))

        units = iter(work)  # shared by the threads

        def drain() -> None:
            try:
                for unit in units:
                    write(unit)
            except BaseException:
                for _ in units:  # a failed save writes no more pieces on any thread
                    pass
                raise

        if threads <= 1 or len(work) < 2:
            drain()
        else:
            with ThreadPoolExecutor(threads) as pool:
                for future in [pool.submit(drain) for _ in range(threads)]:
                    future.result()


def _write_encoded(item: DecodeItem, view: torch.Tensor, writer, reader: CheckpointReader,
                   requantize: bool) -> None:
    """A piece of a dequantized tensor back in its format: with its stored scales, or new ones (written too)."""
    from ..quant import FormatError, Part, get_format

    box = torch.empty(item.box[1], dtype=torch.float32)
    box.view(-1).as_strided(item.sizes, item.strides, item.offset).copy_(apply_steps(view, item.steps))
    fmt = get_format(item.format)
    try:
        if requantize:
            shapes = [Part(p.ckpt_key, p.dtype, reader.inventory.tensors[p.ckpt_key].shape) for p in item.parts]
            codes, scales = fmt.requantize(box, item.box, shapes, dict(item.params))
            written = [codes, scales]
        else:
            scales = [read_part(p, reader) for p in item.parts[1:]]
            covers = tuple((p.offsets, p.sizes) for p in item.parts)
            written = [fmt.encode(box, item.box, covers, scales, dict(item.params))]
    except FormatError as exc:
        raise RemapError(Diagnostic(code="E503", message=f"`{item.runtime_key}` cannot be written back to "
                                    f"`{item.logical}`: {exc}")) from None
    for part, tensor in zip(item.parts, written):
        writer.write_runs(part.file, part.runs, memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B"))
