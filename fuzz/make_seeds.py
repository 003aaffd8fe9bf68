#!/usr/bin/env python3
"""Writes the tiny seed files of the fuzz corpus (fuzz/corpus/<target>/).

The PyTorch files are made the way torch.save makes them, with CPython's pickle and
stand-ins for the torch globals (no torch needed): protocol 2 for the legacy format and
for zip checkpoints, protocol 4 (frames, MEMOIZE, STACK_GLOBAL) for a second zip.
"""
import collections, io, json, os, pickle, struct, sys, types, zipfile

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")

# --- stand-ins for torch globals: only their module/name matter to the pickle -------------
torch = types.ModuleType("torch")
utils = types.ModuleType("torch._utils")
sys.modules["torch"] = torch
sys.modules["torch._utils"] = utils
for name in ["FloatStorage", "HalfStorage", "BFloat16Storage", "LongStorage", "DoubleStorage", "IntStorage"]:
    cls = type(name, (), {})
    cls.__module__ = "torch"
    setattr(torch, name, cls)

def _rebuild_tensor_v2(*a):
    raise RuntimeError("never called")
_rebuild_tensor_v2.__module__ = "torch._utils"
utils._rebuild_tensor_v2 = _rebuild_tensor_v2

ELEM = {"FloatStorage": ("<f", 4), "HalfStorage": ("<e", 2), "BFloat16Storage": (None, 2),
        "LongStorage": ("<q", 8), "DoubleStorage": ("<d", 8), "IntStorage": ("<i", 4)}

class Storage:
    def __init__(self, key, kind, values):
        self.key, self.kind, self.values = key, kind, values
    def raw(self):
        fmt, size = ELEM[self.kind]
        if fmt is None:  # bf16: upper half of f32
            return b"".join(struct.pack("<f", v)[2:] for v in self.values)
        return b"".join(struct.pack(fmt, v) for v in self.values)

class Tensor:
    def __init__(self, storage, offset, shape):
        self.storage, self.offset, self.shape = storage, offset, shape
    def __reduce__(self):
        stride, acc = [], 1
        for d in reversed(self.shape):
            stride.insert(0, acc)
            acc *= d
        return (_rebuild_tensor_v2, (self.storage, self.offset, tuple(self.shape), tuple(stride), False, collections.OrderedDict()))

class TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", getattr(torch, obj.kind), obj.key, "cpu", len(obj.values))
        return None

def state():
    s0 = Storage("0", "HalfStorage", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    s1 = Storage("1", "FloatStorage", [0.5 * i for i in range(8)])
    s2 = Storage("2", "LongStorage", [7, 8, 9])
    s3 = Storage("3", "BFloat16Storage", [1.0, -2.0])
    s4 = Storage("4", "DoubleStorage", [0.25])
    sd = collections.OrderedDict()
    sd["model.diffusion_model.w"] = Tensor(s0, 0, [2, 3])
    sd["model.diffusion_model.b"] = Tensor(s1, 2, [2, 2])
    sd["model.diffusion_model.view"] = Tensor(s1, 0, [8])
    sd["position_ids"] = Tensor(s2, 0, [1, 3])
    sd["first_stage_model.bf"] = Tensor(s3, 0, [2])
    sd["alphas_cumprod"] = Tensor(s4, 0, [1])
    top = {"epoch": 6, "global_step": 470000, "state_dict": sd}
    return top, [s0, s1, s2, s3, s4]

def dumps(obj, protocol):
    f = io.BytesIO()
    TorchPickler(f, protocol=protocol).dump(obj)
    return f.getvalue()

def write(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)

def torch_zip(protocol, compression):
    top, storages = state()
    f = io.BytesIO()
    with zipfile.ZipFile(f, "w", compression) as z:
        z.writestr("archive/data.pkl", dumps(top, protocol))
        z.writestr("archive/byteorder", "little")
        for s in storages:
            z.writestr("archive/data/" + s.key, s.raw())
        z.writestr("archive/version", "3\n")
    return f.getvalue()

def torch_legacy():
    top, storages = state()
    out = pickle.dumps(0x1950a86a20f9469cfc6c, protocol=2)
    out += pickle.dumps(1001, protocol=2)
    out += pickle.dumps({"protocol_version": 1001, "little_endian": True, "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2)
    out += dumps(top, 2)
    keys = sorted(s.key for s in storages)
    out += pickle.dumps(keys, protocol=2)
    by_key = {s.key: s for s in storages}
    for k in keys:
        out += struct.pack("<q", len(by_key[k].values)) + by_key[k].raw()
    return out

def safetensors_file(entries, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data

def gguf_file(kv, tensors, version=3, align=32):
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv))
    for key, t, val in kv:
        out += s(key) + struct.pack("<I", t) + val
    off, blobs = 0, []
    for name, ne, ty, raw in tensors:
        out += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<q", d) for d in ne)
        out += struct.pack("<IQ", ty, off)
        pad = raw + b"\0" * (-len(raw) % align)
        blobs.append(pad)
        off += len(pad)
    out += b"\0" * (-len(out) % align)
    return out + b"".join(blobs)

def main():
    top, _ = state()
    write("pickle", "state_dict_p2.pkl", dumps(top, 2))
    write("pickle", "state_dict_p4.pkl", dumps(top, 4))
    write("torch_zip", "stored_p2.ckpt", torch_zip(2, zipfile.ZIP_STORED))
    write("torch_zip", "stored_p4.ckpt", torch_zip(4, zipfile.ZIP_STORED))
    write("torch_zip", "deflated.ckpt", torch_zip(2, zipfile.ZIP_DEFLATED))
    write("torch_legacy", "legacy.pt", torch_legacy())
    f16 = struct.pack("<8e", *[0.5 * i for i in range(8)])
    f32 = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    write("safetensors", "dtypes.safetensors", safetensors_file([
        ("model.diffusion_model.w", "F16", [2, 4], f16),
        ("first_stage_model.b", "F32", [4], f32),
        ("x.f64", "F64", [2], struct.pack("<2d", 1.5, -1.0)),
        ("x.i64", "I64", [], struct.pack("<q", 3)),
        ("x.f8", "F8_E4M3", [4], bytes([0x38, 0x40, 0xb8, 0x01])),
        ("x.f8b", "F8_E5M2", [2], bytes([0x3c, 0xbc])),
        ("x.bf16", "BF16", [1, 2], struct.pack("<2H", 0x3f80, 0xc000)),
        ("x.i8", "I8", [3], bytes([1, 2, 255])),
        ("x.blob", "U8", [2], b"ok"),
    ], {"format": "pt"}))
    write("safetensors", "one.safetensors", safetensors_file([("w", "F32", [1, 4], f32)]))
    q8 = struct.pack("<e", 0.5) + bytes(range(32))
    write("gguf", "types.gguf", gguf_file(
        [("general.name", 8, struct.pack("<Q", 1) + b"m"),
         ("general.alignment", 4, struct.pack("<I", 32)),
         ("list", 9, struct.pack("<IQ", 4, 2) + struct.pack("<2I", 7, 9)),
         ("flag", 7, b"\x01")],
        [("model.diffusion_model.q", [32, 2], 8, q8 + q8),
         ("model.diffusion_model.h", [8], 1, f16),
         ("first_stage_model.f", [2, 2, 1, 1], 0, f32)]))
    write("gguf", "v2.gguf", gguf_file([], [("w", [4], 0, f32)], version=2))

if __name__ == "__main__":
    main()
