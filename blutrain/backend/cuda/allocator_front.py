"""The caching allocator's hot path in C: a request served by a kept block of its size, and the free that keeps it.

A training step asks for the same sizes every step, so once the cache has settled nearly every `malloc` takes a
block kept under its (stream, size) key and every free puts one back (allocator.py). In Python that pair cost ~1.1 us
(the Block object with its `__del__`, the lock, three statistics); a ResNet-18 step makes ~360 of them, and replacing
them by a bare counter took ~11 % off its host time on the fake GPU. This C extension does the same bookkeeping on the
allocator's own objects (its kept dict, stream ids, statistics), so both paths see one state:

- `Front(allocator, ...)` is called as `malloc(nbytes, stream)`: when no frees wait (`_deferred`, `_pending`), no
  thread holds the allocator's lock and a block is kept under the request's key, it pops that block, counts it and
  returns a `Block`; otherwise it calls the allocator's Python `_malloc`, which does everything else.
- `Block` is allocator.Block in C: the same attributes and methods; when it is collected (or `free()`d) its memory
  goes back through `Front.release`, which keeps the block under its key, or leaves it to the allocator's Python
  `_release` (another stream used it, the lock is held, no list for its key yet).
- `Stat` is allocator._Stat in C (`current`, `peak`, `add`), which both paths update.

The C code calls no Python code on the fast paths (dict and list operations on ints and the streams' ids, slot
reads), so each runs as one step under the GIL, as the lock would make it. Built like the kernel launcher (Triton's
build helper, cached); where it does not build, the allocator runs in Python alone.
"""
from __future__ import annotations

import functools

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#if PY_VERSION_HEX >= 0x030D0000
#define FINALIZING() Py_IsFinalizing()
#else
#define FINALIZING() _Py_IsFinalizing()
#endif

/* *** Stat: a current value and its peak *** */

typedef struct { PyObject_HEAD long long current, peak; } Stat;

static PyObject *stat_add(Stat *self, PyObject *n) {
  long long v = PyLong_AsLongLong(n);
  if (v == -1 && PyErr_Occurred()) return NULL;
  self->current += v;
  if (self->current > self->peak) self->peak = self->current;
  Py_RETURN_NONE;
}

static PyMemberDef stat_members[] = {
  {"current", T_LONGLONG, offsetof(Stat, current), 0, NULL},
  {"peak", T_LONGLONG, offsetof(Stat, peak), 0, NULL},
  {NULL}};
static PyMethodDef stat_methods[] = {{"add", (PyCFunction)stat_add, METH_O, "current += n; peak follows"}, {NULL}};

static PyTypeObject StatType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "blutrain_alloc.Stat", .tp_basicsize = sizeof(Stat), .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_doc = "A statistic of the allocator: current value and peak.", .tp_new = PyType_GenericNew,
  .tp_members = stat_members, .tp_methods = stat_methods};

static inline void stat_move(Stat *s, long long n) {
  s->current += n;
  if (s->current > s->peak) s->peak = s->current;
}

/* *** Front: the allocator's kept-block hit *** */

typedef struct {
  PyObject_HEAD
  PyObject *ref, *slow_malloc, *slow_release;  /* a weak reference to the allocator; its class's malloc and _release */
  PyObject *kept, *sids, *deferred, *pending, *locked;   /* its dicts and lists; its lock's `locked` */
  Stat *allocated, *requested, *active;
  PyObject *device;
  long long min_block;
  PyObject *sid_shift, *size_shift;
  vectorcallfunc vectorcall;
} Front;

static PyTypeObject FrontType, BlockType;
static PyObject *s_ptr, *s_size, *s_requested, *s_kept_as, *s_stream_uses;

typedef struct {
  PyObject_HEAD
  PyObject *ptr, *nbytes, *device, *stream, *b, *alloc, *front;  /* front: the allocator's Front, or None */
  PyObject *weakrefs;
} Block;

/* the allocator, borrowed (alive while the caller holds it or one of its blocks) */
static PyObject *allocator_of(Front *f) {
  PyObject *a = PyWeakref_GetObject(f->ref);
  if (a == Py_None) PyErr_SetString(PyExc_RuntimeError, "the allocator of this Front was collected");
  return a == Py_None ? NULL : a;
}

static PyObject *slow_call(Front *f, PyObject *fn, PyObject *x, PyObject *y) {
  PyObject *a = allocator_of(f);
  return a == NULL ? NULL : PyObject_CallFunctionObjArgs(fn, a, x, y, NULL);
}

static int is_locked(Front *f) {
  PyObject *r = PyObject_CallNoArgs(f->locked);
  if (r == NULL) return -1;
  int locked = PyObject_IsTrue(r);
  Py_DECREF(r);
  return locked;
}

/* the kept key of (sid, size): sid << sid_shift | size << size_shift, as allocator._key(sid, size, 0) */
static PyObject *kept_key(Front *f, PyObject *sid, long long size) {
  PyObject *sz = PyLong_FromLongLong(size), *hi = NULL, *lo = NULL, *key = NULL;
  if (sz == NULL) return NULL;
  if ((lo = PyNumber_Lshift(sz, f->size_shift)) && (hi = PyNumber_Lshift(sid, f->sid_shift))) key = PyNumber_Or(hi, lo);
  Py_DECREF(sz); Py_XDECREF(lo); Py_XDECREF(hi);
  return key;
}

static long long attr_ll(PyObject *o, PyObject *name) {
  PyObject *v = PyObject_GetAttr(o, name);
  if (v == NULL) return -1;
  long long r = PyLong_AsLongLong(v);
  Py_DECREF(v);
  return r;
}

static PyObject *block_new(PyObject *ptr, PyObject *nbytes, PyObject *device, PyObject *stream, PyObject *b,
                           PyObject *alloc, PyObject *front) {
  Block *self = PyObject_New(Block, &BlockType);
  if (self == NULL) return NULL;
  Py_INCREF(ptr); Py_INCREF(nbytes); Py_INCREF(device); Py_INCREF(stream); Py_INCREF(b); Py_INCREF(alloc);
  Py_INCREF(front);
  self->ptr = ptr; self->nbytes = nbytes; self->device = device; self->stream = stream; self->b = b;
  self->alloc = alloc; self->front = front; self->weakrefs = NULL;
  return (PyObject *)self;
}

/* malloc(nbytes, stream): the kept hit, or the allocator's Python malloc */
static PyObject *front_call(Front *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) {
    PyErr_SetString(PyExc_TypeError, "malloc(nbytes, stream) takes two positional arguments");
    return NULL;
  }
  PyObject *nbytes = args[0], *stream = args[1], *alloc = allocator_of(f);
  if (alloc == NULL) return NULL;
  long long req = PyLong_Check(nbytes) ? PyLong_AsLongLong(nbytes) : 0;
  if (req == -1 && PyErr_Occurred()) PyErr_Clear();
  if (req <= 0 || PyList_GET_SIZE(f->deferred) || PyList_GET_SIZE(f->pending)) goto slow;
  int locked = is_locked(f);
  if (locked < 0) return NULL;
  if (locked) goto slow;
  PyObject *sid = PyDict_GetItemWithError(f->sids, stream);   /* borrowed */
  if (sid == NULL) { if (PyErr_Occurred()) return NULL; goto slow; }
  long long size = (req + f->min_block - 1) / f->min_block * f->min_block;
  PyObject *key = kept_key(f, sid, size);
  if (key == NULL) return NULL;
  PyObject *kept = PyDict_GetItemWithError(f->kept, key);      /* borrowed */
  if (kept == NULL || !PyList_CheckExact(kept) || PyList_GET_SIZE(kept) == 0) {
    Py_DECREF(key);
    if (PyErr_Occurred()) return NULL;
    goto slow;
  }
  Py_ssize_t last = PyList_GET_SIZE(kept) - 1;
  PyObject *b = PyList_GET_ITEM(kept, last);
  Py_INCREF(b);
  long long bsize = attr_ll(b, s_size);
  PyObject *ptr = PyObject_GetAttr(b, s_ptr);
  if ((bsize == -1 && PyErr_Occurred()) || ptr == NULL || PyList_SetSlice(kept, last, last + 1, NULL) < 0 ||
      PyObject_SetAttr(b, s_requested, nbytes) < 0 || PyObject_SetAttr(b, s_kept_as, key) < 0) {
    Py_DECREF(b); Py_DECREF(key); Py_XDECREF(ptr);
    return NULL;
  }
  Py_DECREF(key);
  stat_move(f->allocated, bsize);
  stat_move(f->requested, req);
  stat_move(f->active, 1);
  PyObject *block = block_new(ptr, nbytes, f->device, stream, b, alloc, (PyObject *)f);
  Py_DECREF(ptr); Py_DECREF(b);
  return block;
slow:
  return PyObject_CallFunctionObjArgs(f->slow_malloc, alloc, nbytes, stream, NULL);
}

/* Keep b under its key (the allocator's _release, in C when nothing stands in the way); 0 or -1 with an exception */
static int front_release(Front *f, PyObject *b) {
  if (PyList_GET_SIZE(f->deferred)) goto slow;
  int locked = is_locked(f);
  if (locked < 0) return -1;
  if (locked) goto slow;
  PyObject *uses = PyObject_GetAttr(b, s_stream_uses);
  if (uses == NULL) return -1;
  int used = uses != Py_None;
  Py_DECREF(uses);
  if (used) goto slow;
  PyObject *key = PyObject_GetAttr(b, s_kept_as);
  if (key == NULL) return -1;
  PyObject *kept = PyDict_GetItemWithError(f->kept, key);      /* borrowed */
  Py_DECREF(key);
  if (kept == NULL || !PyList_CheckExact(kept)) { if (PyErr_Occurred()) return -1; goto slow; }
  long long size = attr_ll(b, s_size), req = attr_ll(b, s_requested);
  if (PyErr_Occurred()) return -1;
  Py_INCREF(kept);
  int rc = PyList_Append(kept, b);
  Py_DECREF(kept);
  if (rc < 0) return -1;
  stat_move(f->allocated, -size);
  f->requested->current -= req;
  f->active->current -= 1;
  return 0;
slow:;
  PyObject *r = slow_call(f, f->slow_release, b, NULL);
  Py_XDECREF(r);
  return r == NULL ? -1 : 0;
}

static PyObject *front_release_method(Front *f, PyObject *b) {
  if (front_release(f, b) < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *front_vectorcall_entry(PyObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames);

static PyObject *front_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  PyObject *alloc, *slow_malloc, *slow_release, *kept, *sids, *deferred, *pending, *locked, *allocated, *requested,
           *active, *device, *sid_shift, *size_shift;
  long long min_block;
  if (!PyArg_ParseTuple(args, "OOOO!O!O!O!OO!O!O!OLOO", &alloc, &slow_malloc, &slow_release, &PyDict_Type, &kept, &PyDict_Type,
                        &sids, &PyList_Type, &deferred, &PyList_Type, &pending, &locked, &StatType, &allocated,
                        &StatType, &requested, &StatType, &active, &device, &min_block, &sid_shift, &size_shift))
    return NULL;
  PyObject *ref = PyWeakref_NewRef(alloc, NULL);
  if (ref == NULL) return NULL;
  Front *f = (Front *)type->tp_alloc(type, 0);
  if (f == NULL) { Py_DECREF(ref); return NULL; }
  f->ref = ref;
  PyObject **slots[] = {&f->slow_malloc, &f->slow_release, &f->kept, &f->sids, &f->deferred, &f->pending, &f->locked,
                        (PyObject **)&f->allocated, (PyObject **)&f->requested, (PyObject **)&f->active, &f->device,
                        &f->sid_shift, &f->size_shift};
  PyObject *values[] = {slow_malloc, slow_release, kept, sids, deferred, pending, locked, allocated, requested, active,
                        device, sid_shift, size_shift};
  for (size_t i = 0; i < sizeof(values) / sizeof(*values); i++) { Py_INCREF(values[i]); *slots[i] = values[i]; }
  f->min_block = min_block;
  f->vectorcall = front_vectorcall_entry;
  return (PyObject *)f;
}

static int front_traverse(Front *f, visitproc visit, void *arg) {
  Py_VISIT(f->ref); Py_VISIT(f->slow_malloc); Py_VISIT(f->slow_release); Py_VISIT(f->kept); Py_VISIT(f->sids); Py_VISIT(f->deferred);
  Py_VISIT(f->pending); Py_VISIT(f->locked); Py_VISIT(f->allocated); Py_VISIT(f->requested); Py_VISIT(f->active);
  Py_VISIT(f->device);
  return 0;
}

static int front_clear(Front *f) {
  Py_CLEAR(f->ref); Py_CLEAR(f->slow_malloc); Py_CLEAR(f->slow_release); Py_CLEAR(f->kept); Py_CLEAR(f->sids); Py_CLEAR(f->deferred);
  Py_CLEAR(f->pending); Py_CLEAR(f->locked); Py_CLEAR(f->allocated); Py_CLEAR(f->requested); Py_CLEAR(f->active);
  Py_CLEAR(f->device); Py_CLEAR(f->sid_shift); Py_CLEAR(f->size_shift);
  return 0;
}

static void front_dealloc(Front *f) {
  PyObject_GC_UnTrack(f);
  front_clear(f);
  Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyObject *front_vectorcall_entry(PyObject *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
  return front_call((Front *)f, args, nargsf, kwnames);
}

static PyObject *front_tp_call(PyObject *f, PyObject *args, PyObject *kw) {
  return PyVectorcall_Call(f, args, kw);
}

static PyMethodDef front_methods[] = {
  {"_release", (PyCFunction)front_release_method, METH_O, "Keep a freed _Block (allocator._release)."}, {NULL}};

static PyTypeObject FrontType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "blutrain_alloc.Front", .tp_basicsize = sizeof(Front),
  .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
  .tp_doc = "The allocator's malloc(nbytes, stream) for a kept block of the request's size; else its _malloc.",
  .tp_new = front_new, .tp_dealloc = (destructor)front_dealloc, .tp_traverse = (traverseproc)front_traverse,
  .tp_clear = (inquiry)front_clear, .tp_call = front_tp_call, .tp_methods = front_methods,
  .tp_vectorcall_offset = offsetof(Front, vectorcall)};

/* *** Block *** */

/* Block(ptr, nbytes, device, stream, b, alloc): alloc's `_front` (None without one) takes b back */
static PyObject *block_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  PyObject *ptr, *nbytes, *device, *stream, *b, *alloc;
  if (!PyArg_ParseTuple(args, "OOOOOO", &ptr, &nbytes, &device, &stream, &b, &alloc)) return NULL;
  PyObject *front = alloc == Py_None ? NULL : PyObject_GetAttrString(alloc, "_front");
  if (front == NULL && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
    PyErr_Clear();
  }
  PyObject *block = block_new(ptr, nbytes, device, stream, b, alloc,
                              front != NULL && Py_IS_TYPE(front, &FrontType) ? front : Py_None);
  Py_XDECREF(front);
  return block;
}

/* hand b back: through the allocator's Front in C, or the allocator's Python _release */
static int give_back(Block *self, PyObject *b) {
  if (self->front != Py_None) return front_release((Front *)self->front, b);
  PyObject *r = PyObject_CallMethod(self->alloc, "_release", "O", b);
  Py_XDECREF(r);
  return r == NULL ? -1 : 0;
}

static PyObject *block_free(Block *self, PyObject *unused) {
  PyObject *b = self->b;
  self->b = Py_None; Py_INCREF(Py_None);
  int rc = b != Py_None ? give_back(self, b) : 0;
  Py_DECREF(b);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *block_record_stream(Block *self, PyObject *stream) {
  if (stream == self->stream || self->b == Py_None) Py_RETURN_NONE;
  PyObject *uses = PyObject_GetAttr(self->b, s_stream_uses);
  if (uses == NULL) return NULL;
  int rc;
  if (uses == Py_None) {
    PyObject *set = PySet_New(NULL);
    rc = set == NULL ? -1 : PySet_Add(set, stream);
    if (rc == 0) rc = PyObject_SetAttr(self->b, s_stream_uses, set);
    Py_XDECREF(set);
  } else rc = PySet_Add(uses, stream);
  Py_DECREF(uses);
  if (rc < 0) return NULL;
  Py_RETURN_NONE;
}

static PyObject *block_repr(Block *self) {
  PyObject *hex = PyNumber_ToBase(self->ptr, 16);
  if (hex == NULL) return NULL;
  PyObject *r = PyUnicode_FromFormat("Block(ptr=%U, nbytes=%S, device=%S)", hex, self->nbytes, self->device);
  Py_DECREF(hex);
  return r;
}

static void block_dealloc(Block *self) {
  if (self->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)self);
  if (self->b != Py_None && self->alloc != Py_None && !FINALIZING()) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (give_back(self, self->b) < 0) PyErr_WriteUnraisable((PyObject *)self);
    PyErr_Restore(type, value, tb);
  }
  Py_DECREF(self->ptr); Py_DECREF(self->nbytes); Py_DECREF(self->device); Py_DECREF(self->stream); Py_DECREF(self->b);
  Py_DECREF(self->alloc); Py_DECREF(self->front);
  PyObject_Free(self);
}

static PyMemberDef block_members[] = {
  {"ptr", T_OBJECT, offsetof(Block, ptr), READONLY, NULL},
  {"nbytes", T_OBJECT, offsetof(Block, nbytes), READONLY, NULL},
  {"device", T_OBJECT, offsetof(Block, device), READONLY, NULL},
  {"stream", T_OBJECT, offsetof(Block, stream), READONLY, NULL},
  {"_b", T_OBJECT, offsetof(Block, b), READONLY, NULL},
  {"_alloc", T_OBJECT, offsetof(Block, alloc), READONLY, NULL},
  {NULL}};

static PyMethodDef block_methods[] = {
  {"record_stream", (PyCFunction)block_record_stream, METH_O, "Mark this memory as used by work queued on `stream`."},
  {"free", (PyCFunction)block_free, METH_NOARGS, "Return the memory to the cache now."},
  {NULL}};

static PyTypeObject BlockType = {
  PyVarObject_HEAD_INIT(NULL, 0)
  .tp_name = "blutrain_alloc.Block", .tp_basicsize = sizeof(Block), .tp_flags = Py_TPFLAGS_DEFAULT,
  .tp_doc = "Device memory handed out by the allocator (allocator.Block, in C).", .tp_new = block_tp_new,
  .tp_dealloc = (destructor)block_dealloc, .tp_repr = (reprfunc)block_repr, .tp_members = block_members,
  .tp_methods = block_methods, .tp_weaklistoffset = offsetof(Block, weakrefs)};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "blutrain_alloc", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_blutrain_alloc(void) {
  if (PyType_Ready(&StatType) < 0 || PyType_Ready(&FrontType) < 0 || PyType_Ready(&BlockType) < 0) return NULL;
  if (!(s_ptr = PyUnicode_InternFromString("ptr")) || !(s_size = PyUnicode_InternFromString("size")) ||
      !(s_requested = PyUnicode_InternFromString("requested")) ||
      !(s_kept_as = PyUnicode_InternFromString("kept_as")) ||
      !(s_stream_uses = PyUnicode_InternFromString("stream_uses"))) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  if (PyModule_AddObjectRef(m, "Stat", (PyObject *)&StatType) < 0 ||
      PyModule_AddObjectRef(m, "Front", (PyObject *)&FrontType) < 0 ||
      PyModule_AddObjectRef(m, "Block", (PyObject *)&BlockType) < 0) { Py_DECREF(m); return NULL; }
  return m;
}
"""


@functools.cache
def build():
  """The C extension (`Stat`, `Front`, `Block`), compiled (or taken from Triton's cache) and loaded; raises when it
  cannot be built (no C compiler, no Python headers)."""
  from triton.runtime.build import compile_module_from_src
  return compile_module_from_src(SOURCE, "blutrain_alloc")
