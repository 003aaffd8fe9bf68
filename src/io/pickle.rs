//! A pickle interpreter for PyTorch state dicts that never runs code.
//!
//! It evaluates the opcodes of protocols 2-5 into plain data (ints, strings, tuples,
//! lists, dicts). Globals are only names: the few whitelisted torch/collections callables
//! that describe tensors and ordered dicts are interpreted as data constructors, anything
//! else becomes an opaque placeholder. Containers live in an arena addressed by index, so
//! shared and cyclic references cost nothing, and the work and memory are linear in the
//! input size. Walking the result is depth-limited.

use crate::error::{Error, Result};
use crate::types::SdType;
use super::dtype::SourceDtype;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

/// Deepest nesting of dicts searched for tensors.
const MAX_DEPTH: usize = 64;
/// Most dimensions a pickled tensor may have.
const MAX_TENSOR_DIMS: usize = 8;

/// Element type of a torch storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageKind {
    F32,
    F64,
    F16,
    Bf16,
    I32,
    I64,
    I16,
    I8,
}

impl StorageKind {
    fn from_global(name: &str) -> Option<Self> {
        Some(match name {
            "torch.FloatStorage" => StorageKind::F32,
            "torch.DoubleStorage" => StorageKind::F64,
            "torch.HalfStorage" => StorageKind::F16,
            "torch.BFloat16Storage" => StorageKind::Bf16,
            "torch.IntStorage" => StorageKind::I32,
            "torch.LongStorage" => StorageKind::I64,
            "torch.ShortStorage" => StorageKind::I16,
            "torch.CharStorage" => StorageKind::I8,
            _ => return None,
        })
    }

    /// Bytes per element in the file.
    pub fn elem_size(self) -> u64 {
        match self {
            StorageKind::F64 | StorageKind::I64 => 8,
            StorageKind::F32 | StorageKind::I32 => 4,
            StorageKind::F16 | StorageKind::Bf16 | StorageKind::I16 => 2,
            StorageKind::I8 => 1,
        }
    }

    /// The ggml type this is read as and the conversion on the way.
    pub fn read_as(self) -> (SdType, SourceDtype) {
        match self {
            StorageKind::F32 => (SdType::F32, SourceDtype::Native),
            StorageKind::F64 => (SdType::F32, SourceDtype::F64),
            StorageKind::F16 => (SdType::F16, SourceDtype::Native),
            StorageKind::Bf16 => (SdType::Bf16, SourceDtype::Native),
            StorageKind::I32 => (SdType::I32, SourceDtype::Native),
            StorageKind::I64 => (SdType::I32, SourceDtype::I64),
            StorageKind::I16 => (SdType::I16, SourceDtype::Native),
            StorageKind::I8 => (SdType::I8, SourceDtype::Native),
        }
    }
}

/// A storage referenced by the pickle (a file in a torch zip, a block in a legacy file).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageInfo {
    /// `None` for element types we do not read (bool, uint8, complex, ...).
    pub kind: Option<StorageKind>,
    /// The storage type's name, for messages.
    pub type_name: String,
    pub numel: u64,
    /// `numel` times the element size (0 when the element size is unknown).
    pub nbytes: u64,
    /// Bytes per element, when the storage type is known at all.
    pub elem_size: Option<u64>,
}

/// Element size of every torch storage type, including ones we do not read.
fn storage_elem_size(name: &str) -> Option<u64> {
    if let Some(k) = StorageKind::from_global(name) {
        return Some(k.elem_size());
    }
    Some(match name {
        "torch.ByteStorage" | "torch.BoolStorage" | "torch.QUInt8Storage" | "torch.QInt8Storage"
        | "torch.UntypedStorage" => 1,
        "torch.QInt32Storage" => 4,
        "torch.ComplexFloatStorage" => 8,
        "torch.ComplexDoubleStorage" => 16,
        _ => return None,
    })
}

/// One tensor of a state dict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickleTensor {
    pub name: String,
    pub storage_key: String,
    /// Byte offset inside the storage.
    pub offset: u64,
    /// Shape in torch order (outermost first).
    pub shape: Vec<i64>,
}

/// The tensors of a state dict and the storages they live in.
#[derive(Debug, Default)]
pub struct StateDict {
    pub tensors: Vec<PickleTensor>,
    pub storages: HashMap<String, StorageInfo>,
    /// Storage keys in the order the pickle first mentions them.
    pub storage_order: Vec<String>,
}

/// Why evaluation stopped.
#[derive(Debug)]
pub(crate) enum PickleError {
    /// The input ended before STOP (more bytes may complete it).
    Truncated,
    Invalid(String),
}

impl From<PickleError> for Error {
    fn from(e: PickleError) -> Error {
        match e {
            PickleError::Truncated => Error::new("truncated pickle"),
            PickleError::Invalid(m) => Error::new(m),
        }
    }
}

type PResult<T> = std::result::Result<T, PickleError>;

fn invalid<T>(msg: impl Into<String>) -> PResult<T> {
    Err(PickleError::Invalid(msg.into()))
}

/// A pickled value. Containers are arena indices.
#[derive(Debug, Clone)]
pub(crate) enum Value {
    None,
    #[allow(dead_code)] // the payload only shows in Debug output
    Bool(bool),
    Int(i64),
    /// An integer wider than 64 bits: its little-endian two's complement bytes.
    BigInt(Rc<[u8]>),
    #[allow(dead_code)]
    Float(f64),
    Str(Rc<str>),
    Global(Rc<str>),
    Obj(usize),
}

#[derive(Debug)]
enum Obj {
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Storage(Rc<str>),
    Tensor(PickleTensorData),
    /// The result of a call we do not interpret (or the state it was built with).
    Opaque,
}

#[derive(Debug, Clone)]
struct PickleTensorData {
    storage_key: Rc<str>,
    offset: u64,
    shape: Vec<i64>,
}

pub(crate) struct Vm<'a> {
    buf: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    objs: Vec<Obj>,
    storages: HashMap<String, StorageInfo>,
    storage_order: Vec<String>,
}

const TORCH_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

impl<'a> Vm<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Vm {
            buf,
            pos: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
            objs: Vec::new(),
            storages: HashMap::new(),
            storage_order: Vec::new(),
        }
    }

    fn take(&mut self, n: usize) -> PResult<&'a [u8]> {
        if n > self.buf.len() - self.pos {
            return Err(PickleError::Truncated);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn byte(&mut self) -> PResult<u8> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> PResult<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    fn u32(&mut self) -> PResult<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> PResult<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn line(&mut self) -> PResult<&'a [u8]> {
        let rest = &self.buf[self.pos..];
        match rest.iter().position(|&b| b == b'\n') {
            Some(n) => {
                self.pos += n + 1;
                Ok(&rest[..n])
            }
            None => Err(PickleError::Truncated),
        }
    }

    fn sized(&mut self, n: u64) -> PResult<&'a [u8]> {
        if n > (self.buf.len() - self.pos) as u64 {
            return Err(PickleError::Truncated);
        }
        self.take(n as usize)
    }

    fn push(&mut self, v: Value) {
        self.stack.push(v);
    }

    fn new_obj(&mut self, o: Obj) -> Value {
        self.objs.push(o);
        Value::Obj(self.objs.len() - 1)
    }

    fn pop(&mut self) -> PResult<Value> {
        if self.marks.last() == Some(&self.stack.len()) {
            return invalid("pickle pops a mark as a value");
        }
        self.stack.pop().map_or_else(|| invalid("pickle stack underflow"), Ok)
    }

    fn top(&self) -> PResult<&Value> {
        if self.marks.last() == Some(&self.stack.len()) {
            return invalid("pickle uses a mark as a value");
        }
        self.stack.last().map_or_else(|| invalid("pickle stack underflow"), Ok)
    }

    /// Removes everything above the topmost mark, and the mark.
    fn pop_mark(&mut self) -> PResult<Vec<Value>> {
        let m = self.marks.pop().map_or_else(|| invalid("pickle has no mark to pop"), Ok)?;
        Ok(self.stack.split_off(m))
    }

    fn text(b: &[u8]) -> Rc<str> {
        Rc::from(String::from_utf8_lossy(b).as_ref())
    }

    fn long(bytes: &[u8]) -> Value {
        if bytes.is_empty() {
            return Value::Int(0);
        }
        if bytes.len() <= 8 {
            let fill = if bytes[bytes.len() - 1] & 0x80 != 0 { 0xff } else { 0 };
            let mut b = [fill; 8];
            b[..bytes.len()].copy_from_slice(bytes);
            return Value::Int(i64::from_le_bytes(b));
        }
        Value::BigInt(Rc::from(bytes))
    }

    fn int_line(line: &[u8]) -> Value {
        let s = String::from_utf8_lossy(line);
        let s = s.trim().trim_end_matches('L');
        match s {
            "01" => Value::Bool(true),
            "00" => Value::Bool(false),
            _ => s.parse::<i64>().map(Value::Int).unwrap_or(Value::None),
        }
    }

    /// Evaluates one pickle (which must start with PROTO 2..5) up to STOP and returns
    /// its value; `self.pos` is then the pickle's length.
    pub(crate) fn run(&mut self) -> PResult<Value> {
        if self.buf.len() < 2 {
            return Err(PickleError::Truncated);
        }
        if self.buf[0] != 0x80 || !(2..=5).contains(&self.buf[1]) {
            return invalid("unsupported pickle protocol (torch files use protocol 2 to 5)");
        }
        self.pos = 2;
        loop {
            let at = self.pos;
            let op = self.byte()?;
            match op {
                b'.' => {
                    let v = self.pop()?;
                    return Ok(v);
                }
                0x80 => {
                    self.byte()?;
                }
                0x95 => {
                    self.u64()?;
                }
                b'(' => self.marks.push(self.stack.len()),
                b'}' => {
                    let v = self.new_obj(Obj::Dict(Vec::new()));
                    self.push(v)
                }
                b']' | 0x8f => {
                    let v = self.new_obj(Obj::List(Vec::new()));
                    self.push(v)
                }
                b')' => {
                    let v = self.new_obj(Obj::Tuple(Vec::new()));
                    self.push(v)
                }
                b'N' => self.push(Value::None),
                0x88 => self.push(Value::Bool(true)),
                0x89 => self.push(Value::Bool(false)),
                b'K' => {
                    let v = self.byte()? as i64;
                    self.push(Value::Int(v))
                }
                b'M' => {
                    let v = self.u16()? as i64;
                    self.push(Value::Int(v))
                }
                b'J' => {
                    let v = self.u32()? as i32 as i64;
                    self.push(Value::Int(v))
                }
                b'I' | b'L' => {
                    let l = self.line()?;
                    self.push(Self::int_line(l))
                }
                b'F' => {
                    let l = self.line()?;
                    let v = String::from_utf8_lossy(l).trim().parse::<f64>().unwrap_or(f64::NAN);
                    self.push(Value::Float(v))
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes"));
                    self.push(Value::Float(v))
                }
                0x8a => {
                    let n = self.byte()? as u64;
                    let b = self.sized(n)?;
                    self.push(Self::long(b))
                }
                0x8b => {
                    let n = self.u32()? as i32;
                    if n < 0 {
                        return invalid("negative LONG4 length in pickle");
                    }
                    let b = self.sized(n as u64)?;
                    self.push(Self::long(b))
                }
                b'C' | b'U' | 0x8c => {
                    let n = self.byte()? as u64;
                    let b = self.sized(n)?;
                    self.push(Value::Str(Self::text(b)))
                }
                b'B' | b'T' | b'X' => {
                    let n = self.u32()?;
                    if op != b'B' && n > i32::MAX as u32 {
                        return invalid("negative string length in pickle");
                    }
                    let b = self.sized(n as u64)?;
                    self.push(Value::Str(Self::text(b)))
                }
                0x8d | 0x8e | 0x96 => {
                    let n = self.u64()?;
                    let b = self.sized(n)?;
                    self.push(Value::Str(Self::text(b)))
                }
                b'S' => {
                    let l = self.line()?;
                    let q = l.first().copied();
                    let s = if l.len() >= 2 && (q == Some(b'\'') || q == Some(b'"')) && l.last().copied() == q {
                        &l[1..l.len() - 1]
                    } else {
                        l
                    };
                    self.push(Value::Str(Self::text(s)))
                }
                b'V' => {
                    let l = self.line()?;
                    self.push(Value::Str(Self::text(l)))
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = format!("{}.{}", String::from_utf8_lossy(module), String::from_utf8_lossy(name));
                    self.push(Value::Global(Rc::from(g.as_str())))
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => self.push(Value::Global(Rc::from(format!("{m}.{n}").as_str()))),
                        _ => return invalid("STACK_GLOBAL needs two strings"),
                    }
                }
                b'h' | b'j' | b'g' => {
                    let k = self.memo_key(op)?;
                    self.memo_get(k)?
                }
                b'q' | b'r' | b'p' => {
                    let k = self.memo_key(op)?;
                    self.memo_put(k)?
                }
                0x94 => {
                    let k = self.memo.len() as u32;
                    self.memo_put(k)?
                }
                b'0' => {
                    if self.marks.last() == Some(&self.stack.len()) {
                        self.marks.pop();
                    } else {
                        self.pop()?;
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v)
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let floor = self.marks.last().copied().unwrap_or(0);
                    if self.stack.len() < floor + n {
                        return invalid("pickle stack underflow");
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    let v = self.new_obj(Obj::Tuple(items));
                    self.push(v)
                }
                b't' => {
                    let items = self.pop_mark()?;
                    let v = self.new_obj(Obj::Tuple(items));
                    self.push(v)
                }
                b'l' => {
                    let items = self.pop_mark()?;
                    let v = self.new_obj(Obj::List(items));
                    self.push(v)
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(items)?;
                    let v = self.new_obj(Obj::Dict(pairs));
                    self.push(v)
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    let v = self.new_obj(Obj::List(items));
                    self.push(v)
                }
                b'a' => {
                    let item = self.pop()?;
                    let target = self.top()?.clone();
                    self.extend(&target, vec![item])?
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    let target = self.top()?.clone();
                    self.extend(&target, items)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    let target = self.top()?.clone();
                    self.set_items(&target, vec![(k, v)])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let target = self.top()?.clone();
                    let p = pairs(items)?;
                    self.set_items(&target, p)?
                }
                b'b' => {
                    // BUILD: the object keeps its value; the state is data we do not need.
                    self.pop()?;
                    self.top()?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent_storage(&pid)?;
                    self.push(v)
                }
                b'P' => {
                    self.line()?;
                    let v = self.new_obj(Obj::Opaque);
                    self.push(v)
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let v = self.reduce(&callable, &args)?;
                    self.push(v)
                }
                0x81 => {
                    self.pop()?;
                    self.pop()?;
                    let v = self.new_obj(Obj::Opaque);
                    self.push(v)
                }
                0x92 => {
                    self.pop()?;
                    self.pop()?;
                    self.pop()?;
                    let v = self.new_obj(Obj::Opaque);
                    self.push(v)
                }
                b'o' => {
                    self.pop_mark()?;
                    let v = self.new_obj(Obj::Opaque);
                    self.push(v)
                }
                b'i' => {
                    self.line()?;
                    self.line()?;
                    self.pop_mark()?;
                    let v = self.new_obj(Obj::Opaque);
                    self.push(v)
                }
                _ => return invalid(format!("unsupported pickle opcode 0x{op:02X} at offset {at}")),
            }
        }
    }

    /// The memo index argument of GET/PUT: one byte, four bytes or a decimal line.
    fn memo_key(&mut self, op: u8) -> PResult<u32> {
        match op {
            b'h' | b'q' => Ok(self.byte()? as u32),
            b'j' | b'r' => self.u32(),
            _ => {
                let l = self.line()?;
                String::from_utf8_lossy(l).trim().parse::<u32>().map_err(|_| PickleError::Invalid("bad memo index in pickle".into()))
            }
        }
    }

    fn memo_get(&mut self, k: u32) -> PResult<()> {
        match self.memo.get(&k) {
            Some(v) => {
                let v = v.clone();
                self.push(v);
                Ok(())
            }
            None => invalid(format!("pickle memo entry {k} is not defined")),
        }
    }

    fn memo_put(&mut self, k: u32) -> PResult<()> {
        let v = self.top()?.clone();
        self.memo.insert(k, v);
        Ok(())
    }

    fn extend(&mut self, target: &Value, items: Vec<Value>) -> PResult<()> {
        match target {
            Value::Obj(i) => match &mut self.objs[*i] {
                Obj::List(l) => {
                    l.extend(items);
                    Ok(())
                }
                // A subclass or unknown object: its items are not needed.
                Obj::Opaque => Ok(()),
                _ => invalid("pickle appends to something that is not a list"),
            },
            _ => invalid("pickle appends to something that is not a list"),
        }
    }

    fn set_items(&mut self, target: &Value, items: Vec<(Value, Value)>) -> PResult<()> {
        match target {
            Value::Obj(i) => match &mut self.objs[*i] {
                Obj::Dict(d) => {
                    d.extend(items);
                    Ok(())
                }
                Obj::Opaque => Ok(()),
                _ => invalid("pickle sets items on something that is not a dict"),
            },
            _ => invalid("pickle sets items on something that is not a dict"),
        }
    }

    fn obj(&self, v: &Value) -> Option<&Obj> {
        match v {
            Value::Obj(i) => self.objs.get(*i),
            _ => None,
        }
    }

    fn tuple(&self, v: &Value) -> Option<&[Value]> {
        match self.obj(v) {
            Some(Obj::Tuple(t)) => Some(t),
            _ => None,
        }
    }

    /// A torch persistent id: ('storage', StorageType, key, location, numel, ...).
    fn persistent_storage(&mut self, pid: &Value) -> PResult<Value> {
        let t = self.tuple(pid).ok_or_else(|| PickleError::Invalid("persistent id is not a tuple".into()))?;
        let (tag, ty, key, numel) = match t {
            [Value::Str(tag), Value::Global(ty), key, _, Value::Int(numel), ..] => (tag.clone(), ty.clone(), key.clone(), *numel),
            _ => return invalid("unsupported persistent id in torch pickle"),
        };
        if &*tag != "storage" {
            return invalid(format!("unsupported persistent id '{tag}' in torch pickle"));
        }
        let key: Rc<str> = match key {
            Value::Str(s) => s,
            Value::Int(i) => Rc::from(i.to_string().as_str()),
            _ => return invalid("invalid storage key in torch pickle"),
        };
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return invalid(format!("invalid storage key '{key}' in torch pickle"));
        }
        if numel < 0 {
            return invalid("invalid storage size in torch pickle");
        }
        let kind = StorageKind::from_global(&ty);
        let elem_size = storage_elem_size(&ty);
        let nbytes = match elem_size {
            Some(e) => (numel as u64)
                .checked_mul(e)
                .filter(|&n| n <= i64::MAX as u64)
                .ok_or_else(|| PickleError::Invalid("invalid storage size in torch pickle".into()))?,
            None => 0,
        };
        let info = StorageInfo { kind, type_name: ty.to_string(), numel: numel as u64, nbytes, elem_size };
        match self.storages.get(&*key) {
            Some(old) if *old != info => {
                return invalid(format!("storage '{key}' is declared twice with different types or sizes"));
            }
            Some(_) => {}
            None => {
                self.storage_order.push(key.to_string());
                self.storages.insert(key.to_string(), info);
            }
        }
        Ok(self.new_obj(Obj::Storage(key)))
    }

    fn reduce(&mut self, callable: &Value, args: &Value) -> PResult<Value> {
        let name = match callable {
            Value::Global(g) => g.clone(),
            _ => return Ok(self.new_obj(Obj::Opaque)),
        };
        let Some(args_t) = self.tuple(args) else {
            return Ok(self.new_obj(Obj::Opaque));
        };
        match &*name {
            "collections.OrderedDict" => {
                if args_t.is_empty() {
                    return Ok(self.new_obj(Obj::Dict(Vec::new())));
                }
                Ok(self.new_obj(Obj::Opaque))
            }
            "torch._utils._rebuild_tensor_v2" | "torch._utils._rebuild_tensor" => {
                let t = self.rebuild_tensor(args_t)?;
                Ok(self.new_obj(Obj::Tensor(t)))
            }
            "torch._utils._rebuild_parameter" | "torch._utils._rebuild_parameter_with_state" => {
                match args_t.first() {
                    Some(v @ Value::Obj(i)) if matches!(self.objs.get(*i), Some(Obj::Tensor(_))) => Ok(v.clone()),
                    _ => Ok(self.new_obj(Obj::Opaque)),
                }
            }
            _ => Ok(self.new_obj(Obj::Opaque)),
        }
    }

    fn ints(&self, v: &Value, what: &str) -> PResult<Vec<i64>> {
        let t = self.tuple(v).ok_or_else(|| PickleError::Invalid(format!("tensor {what} is not a tuple")))?;
        if t.len() > MAX_TENSOR_DIMS {
            return invalid(format!("tensor has {} dimensions", t.len()));
        }
        t.iter()
            .map(|x| match x {
                Value::Int(i) => Ok(*i),
                _ => invalid(format!("tensor {what} holds a non-integer")),
            })
            .collect()
    }

    /// `_rebuild_tensor_v2(storage, storage_offset, size, stride, ...)`.
    fn rebuild_tensor(&self, args: &[Value]) -> PResult<PickleTensorData> {
        let (storage, offset, size, stride) = match args {
            [s, Value::Int(o), size, stride, ..] => (s, *o, size, stride),
            _ => return invalid("unsupported tensor arguments in torch pickle"),
        };
        let key = match self.obj(storage) {
            Some(Obj::Storage(k)) => k.clone(),
            _ => return invalid("tensor is not backed by a storage in torch pickle"),
        };
        let shape = self.ints(size, "size")?;
        let stride = self.ints(stride, "stride")?;
        let bad = || PickleError::Invalid("invalid tensor shape or stride in torch pickle".into());
        if offset < 0 || shape.iter().any(|&d| d < 0) {
            return Err(bad());
        }
        let n: Option<i64> = shape.iter().try_fold(1i64, |a, &d| a.checked_mul(d));
        let n = n.ok_or_else(bad)?;
        if n != 0 {
            // Only contiguous row-major tensors map to a byte range.
            if stride.len() != shape.len() {
                return Err(bad());
            }
            let mut expect = 1i64;
            for (&d, &s) in shape.iter().zip(&stride).rev() {
                if s != expect && d != 1 {
                    return Err(bad());
                }
                expect = expect.checked_mul(d).ok_or_else(bad)?;
            }
        }
        let info = &self.storages[&*key];
        let elem = info.elem_size.unwrap_or(1);
        let offset = (offset as u64).checked_mul(elem).filter(|&o| o <= i64::MAX as u64).ok_or_else(bad)?;
        Ok(PickleTensorData { storage_key: key, offset, shape })
    }

    /// Collects `name → tensor` entries of every dict reachable through dict values.
    fn collect(&self, v: &Value, depth: usize, seen: &mut HashSet<usize>, out: &mut Vec<PickleTensor>) -> PResult<()> {
        let Value::Obj(i) = v else { return Ok(()) };
        let Some(Obj::Dict(items)) = self.objs.get(*i) else { return Ok(()) };
        if depth > MAX_DEPTH {
            return invalid("torch pickle nests dicts too deeply");
        }
        if !seen.insert(*i) {
            return Ok(());
        }
        for (k, val) in items {
            match (k, self.obj(val)) {
                (Value::Str(name), Some(Obj::Tensor(t))) => out.push(PickleTensor {
                    name: name.to_string(),
                    storage_key: t.storage_key.to_string(),
                    offset: t.offset,
                    shape: t.shape.clone(),
                }),
                (_, Some(Obj::Dict(_))) => self.collect(val, depth + 1, seen, out)?,
                _ => {}
            }
        }
        Ok(())
    }
}

fn pairs(items: Vec<Value>) -> PResult<Vec<(Value, Value)>> {
    if items.len() % 2 != 0 {
        return invalid("pickle sets a key without a value");
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Ok(out)
}

/// Parses a torch state-dict pickle at the start of `buf`. Returns the tensors found in
/// the top-level dict and its nested dicts, and the pickle's length in bytes.
pub(crate) fn parse_state_dict_prefix(buf: &[u8]) -> PResult<(StateDict, usize)> {
    let mut vm = Vm::new(buf);
    let top = vm.run()?;
    let mut tensors = Vec::new();
    vm.collect(&top, 0, &mut HashSet::new(), &mut tensors)?;
    if tensors.is_empty() {
        return invalid("torch pickle does not contain a supported state_dict");
    }
    let len = vm.pos;
    Ok((StateDict { tensors, storages: vm.storages, storage_order: vm.storage_order }, len))
}

/// Parses a complete torch state-dict pickle (e.g. a zip's data.pkl).
pub fn parse_state_dict(buf: &[u8]) -> Result<StateDict> {
    Ok(parse_state_dict_prefix(buf)?.0)
}

/// What a small standalone pickle evaluated to (legacy torch files start with a few).
#[derive(Debug, PartialEq)]
pub(crate) enum Simple {
    TorchMagic,
    Int(i64),
    StrList(Vec<String>),
    Other,
}

/// Evaluates one standalone pickle at the start of `buf`; returns its kind and length.
pub(crate) fn eval_simple(buf: &[u8]) -> PResult<(Simple, usize)> {
    let mut vm = Vm::new(buf);
    let v = vm.run()?;
    let s = match &v {
        Value::BigInt(b) if **b == TORCH_MAGIC => Simple::TorchMagic,
        Value::Int(i) => Simple::Int(*i),
        Value::Obj(_) => match vm.obj(&v) {
            Some(Obj::List(items)) => {
                let strs: Option<Vec<String>> = items
                    .iter()
                    .map(|x| match x {
                        Value::Str(s) => Some(s.to_string()),
                        _ => None,
                    })
                    .collect();
                strs.map_or(Simple::Other, Simple::StrList)
            }
            _ => Simple::Other,
        },
        _ => Simple::Other,
    };
    Ok((s, vm.pos))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Pickle writer for tests: emits protocol-2 opcodes.
    #[derive(Default)]
    pub struct P(pub Vec<u8>);

    impl P {
        pub fn new() -> Self {
            P(vec![0x80, 2])
        }
        pub fn op(&mut self, b: &[u8]) -> &mut Self {
            self.0.extend_from_slice(b);
            self
        }
        pub fn s(&mut self, s: &str) -> &mut Self {
            self.0.push(b'X');
            self.0.extend_from_slice(&(s.len() as u32).to_le_bytes());
            self.0.extend_from_slice(s.as_bytes());
            self
        }
        pub fn int(&mut self, i: i64) -> &mut Self {
            self.0.push(b'J');
            self.0.extend_from_slice(&(i as i32).to_le_bytes());
            self
        }
        pub fn global(&mut self, m: &str, n: &str) -> &mut Self {
            self.0.push(b'c');
            self.0.extend_from_slice(format!("{m}\n{n}\n").as_bytes());
            self
        }
        pub fn tuple_ints(&mut self, v: &[i64]) -> &mut Self {
            self.op(b"(");
            for &i in v {
                self.int(i);
            }
            self.op(b"t")
        }
        /// A `_rebuild_tensor_v2` call on storage `key`.
        pub fn tensor(&mut self, storage: &str, key: &str, numel: i64, offset: i64, shape: &[i64], stride: &[i64]) -> &mut Self {
            self.global("torch._utils", "_rebuild_tensor_v2").op(b"(");
            self.op(b"(").s("storage").global("torch", storage).s(key).s("cpu").int(numel).op(b"tQ");
            self.int(offset).tuple_ints(shape).tuple_ints(stride).op(b"\x89").global("collections", "OrderedDict").op(b")R");
            self.op(b"tR")
        }
        pub fn done(&mut self) -> Vec<u8> {
            self.0.push(b'.');
            self.0.clone()
        }
    }

    /// `{"state_dict": OrderedDict(a: f16[2,3], b: f32[4] at offset 1)}` with memo use.
    pub fn sample() -> Vec<u8> {
        let mut p = P::new();
        p.op(b"}q\x00(").s("epoch").int(6).s("state_dict");
        p.global("collections", "OrderedDict").op(b")Rq\x01(");
        p.s("a").tensor("HalfStorage", "0", 6, 0, &[2, 3], &[3, 1]);
        p.s("b").tensor("FloatStorage", "1", 5, 1, &[4], &[1]);
        p.op(b"u}b"); // fill the OrderedDict, then BUILD it with an empty state
        p.op(b"u");
        p.done()
    }

    #[test]
    fn parses_nested_state_dict() {
        let sd = parse_state_dict(&sample()).unwrap();
        assert_eq!(sd.tensors.len(), 2);
        assert_eq!(sd.tensors[0], PickleTensor { name: "a".into(), storage_key: "0".into(), offset: 0, shape: vec![2, 3] });
        assert_eq!(sd.tensors[1].offset, 4);
        assert_eq!(sd.storages["0"].nbytes, 12);
        assert_eq!(sd.storages["1"].kind, Some(StorageKind::F32));
        assert_eq!(sd.storage_order, vec!["0", "1"]);
    }

    #[test]
    fn memo_and_shared_storages() {
        let mut p = P::new();
        p.op(b"}(").s("a").tensor("FloatStorage", "7", 8, 0, &[2, 2], &[2, 1]).op(b"q\x05");
        p.s("b").op(b"h\x05").s("c").tensor("FloatStorage", "7", 8, 4, &[4], &[1]).op(b"u");
        let sd = parse_state_dict(&p.done()).unwrap();
        let names: Vec<_> = sd.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(sd.tensors[2].offset, 16);
        assert_eq!(sd.storages.len(), 1);
    }

    #[test]
    fn unknown_globals_are_data_only() {
        // os.system("...") is a name and an opaque value, never a call.
        let mut p = P::new();
        p.op(b"}(").s("x").global("os", "system").op(b"(").s("touch /tmp/pwned").op(b"tR");
        p.s("w").tensor("FloatStorage", "0", 1, 0, &[1], &[1]).op(b"u");
        let sd = parse_state_dict(&p.done()).unwrap();
        assert_eq!(sd.tensors.len(), 1);
        // builtins.eval via STACK_GLOBAL + NEWOBJ is just as inert
        let mut p = P::new();
        p.op(b"}(").s("builtins").s("eval").op(b"\x93").op(b")\x81").op(b"0");
        p.s("w").tensor("FloatStorage", "0", 1, 0, &[1], &[1]).op(b"u");
        assert_eq!(parse_state_dict(&p.done()).unwrap().tensors.len(), 1);
    }

    fn err(b: &[u8]) -> String {
        match parse_state_dict_prefix(b) {
            Err(PickleError::Invalid(m)) => m,
            Err(PickleError::Truncated) => "truncated".into(),
            Ok(_) => panic!("parsed"),
        }
    }

    #[test]
    fn hostile_pickles() {
        assert_eq!(err(&sample()[..50]), "truncated");
        assert!(err(b"\x80\x01}.").contains("protocol"));
        assert!(err(b"\x80\x02}.").contains("does not contain"));
        assert!(err(b"\x80\x02h\x09.").contains("memo entry 9"));
        assert!(err(b"\x80\x02u.").contains("no mark"));
        assert!(err(b"\x80\x02\xff").contains("opcode 0xFF"));
        assert!(err(b"\x80\x02.").contains("underflow"));
        assert!(err(b"\x80\x02(.").contains("mark"));
        assert!(err(b"\x80\x02K\x00K\x01K\x02s.").contains("not a dict"));
        assert_eq!(err(b"\x80\x02X\xff\xff\xff\x7f"), "truncated");
        assert!(err(b"\x80\x02X\xff\xff\xff\xff").contains("negative"));
        assert_eq!(err(b"\x80\x02\x8d\xff\xff\xff\xff\xff\xff\xff\xff"), "truncated");
        // non-contiguous strides, negative sizes, overflowing shapes, bad storage keys
        let mut p = P::new();
        p.op(b"}(").s("a").tensor("FloatStorage", "0", 6, 0, &[2, 3], &[1, 2]).op(b"u");
        assert!(err(&p.done()).contains("stride"));
        let mut p = P::new();
        p.op(b"}(").s("a").tensor("FloatStorage", "0", 6, 0, &[-2, 3], &[3, 1]).op(b"u");
        assert!(err(&p.done()).contains("shape"));
        let mut p = P::new();
        p.op(b"}(").s("a").tensor("FloatStorage", "0", 6, -1, &[2], &[1]).op(b"u");
        assert!(err(&p.done()).contains("shape"));
        let mut p = P::new();
        p.op(b"}(").s("a").tensor("FloatStorage", "../x", 6, 0, &[2], &[1]).op(b"u");
        assert!(err(&p.done()).contains("storage key"));
        let mut p = P::new();
        p.op(b"}(").s("a").tensor("FloatStorage", "0", 6, 0, &[2], &[1]);
        p.s("b").tensor("HalfStorage", "0", 6, 0, &[2], &[1]).op(b"u");
        assert!(err(&p.done()).contains("declared twice"));
        let big = {
            let mut p = P::new();
            p.op(b"}(").s("a").tensor("FloatStorage", "0", 6, 0, &[i32::MAX as i64; 3], &[1, 1, 1]).op(b"u");
            p.done()
        };
        assert!(err(&big).contains("shape"));
    }

    #[test]
    fn cycles_depth_and_blowup_are_bounded() {
        // A list that contains itself, DUP'd and memoised many times: linear work.
        let mut p = P::new();
        p.op(b"]q\x00");
        for _ in 0..10000 {
            p.op(b"h\x00h\x00a0");
        }
        p.op(b"0}(").s("w").tensor("FloatStorage", "0", 1, 0, &[1], &[1]).op(b"u");
        assert_eq!(parse_state_dict(&p.done()).unwrap().tensors.len(), 1);
        // A dict that contains itself
        let mut p = P::new();
        p.op(b"}q\x00(").s("self").op(b"h\x00").s("w").tensor("FloatStorage", "0", 1, 0, &[1], &[1]).op(b"u");
        assert_eq!(parse_state_dict(&p.done()).unwrap().tensors.len(), 1);
        // Deeply nested dicts
        let mut p = P::new();
        for _ in 0..200 {
            p.op(b"}(").s("k");
        }
        p.op(b"}(").s("w").tensor("FloatStorage", "0", 1, 0, &[1], &[1]).op(b"u");
        for _ in 0..200 {
            p.op(b"u");
        }
        assert!(err(&p.done()).contains("too deeply"));
        // Many nested tuples: the interpreter is not recursive.
        let mut b = vec![0x80, 2];
        b.extend(std::iter::repeat_n(b')', 1).chain(std::iter::repeat_n(0x85, 200000)));
        b.push(b'.');
        assert!(err(&b).contains("does not contain"));
    }

    #[test]
    fn simple_values() {
        let magic = [&[0x80u8, 2, 0x8a, 10][..], &TORCH_MAGIC, b"."].concat();
        assert_eq!(eval_simple(&magic).unwrap(), (Simple::TorchMagic, 15));
        assert_eq!(eval_simple(b"\x80\x02M\xe9\x03.").unwrap().0, Simple::Int(1001));
        assert_eq!(eval_simple(b"\x80\x02\x8a\x01\xff.").unwrap().0, Simple::Int(-1));
        let mut p = P::new();
        p.op(b"]q\x00(").s("0").s("1").op(b"e");
        assert_eq!(eval_simple(&p.done()).unwrap().0, Simple::StrList(vec!["0".into(), "1".into()]));
    }
}
