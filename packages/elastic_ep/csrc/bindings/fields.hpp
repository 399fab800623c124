// elastic_ep/csrc/bindings/fields.hpp -- a parameter block (kernels/launch.hpp) bound from one table of
// its members (pybind11 TUs only).
//
// Contract. fields_of<S>() is S's table: its Python name and one EP_FIELD(S, member) line per member
// (bindings/params.cpp). bind_fields<S>(m, doc) makes the Python class from it:
//   S(**members)       keyword constructor: every name a member's (TypeError otherwise), members not
//                      given are zero
//   s.<member>         a property per member: integers as Python ints, pointers as ints (addresses);
//                      a pointer member also takes None (0) or an object with data_ptr() (a tensor)
//   s.set(**members)   sets the named members in one call, the cheap way to fill a block before each
//                      launch. Every pointer member must be among them (0 for none), so no address of
//                      an earlier launch survives into the next one.
//   S.fields           every member's name, in declaration order; S.pointer_fields: the pointers'
// A value that is not an int, or does not fit its member, raises (TypeError / OverflowError) naming
// S.member. A new member is one line in its struct and one line in its table.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace elastic_ep::bindings {

template <typename S>
struct Field {
  const char* name;
  bool pointer;
  bool (*set)(S& s, PyObject* v, const char* owner, const char* name);  // false: a Python error is set
  PyObject* (*get)(const S& s);                                         // new reference (null: error set)
};

template <typename S>
struct FieldTable {
  const char* name;  // the Python class's
  std::vector<Field<S>> fields;
  mutable std::vector<PyObject*> py_names = {};  // interned field names (bind_fields)
  mutable uint64_t pointer_mask = 0;             // bit i: fields[i] is a pointer
};

// Specialised once per parameter block (params.cpp).
template <typename S>
const FieldTable<S>& fields_of();

namespace fields_detail {

template <typename>
struct MemberOf;
template <typename C, typename T>
struct MemberOf<T C::*> {
  using Class = C;
  using Type = T;
};

inline bool fail(PyObject* exc, const char* owner, const char* name, const char* what, PyObject* v) {
  PyErr_Clear();
  PyErr_Format(exc, "%s.%s: expected %s, got %R", owner, name, what, v);
  return false;
}

static_assert(sizeof(long) == 8, "the conversions below take C longs as 64-bit (LP64)");

// The object's data_ptr(), through the method of its type, looked up once per type (a tensor's).
inline PyObject* call_data_ptr(PyObject* v) {
  static PyObject* name = PyUnicode_InternFromString("data_ptr");
  static PyTypeObject* type = nullptr;  // the last type seen, and its data_ptr (both kept alive)
  static PyObject* method = nullptr;
  if (Py_TYPE(v) != type) {
    PyObject* m = PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(v)), name);
    if (m == nullptr) return nullptr;
    Py_XDECREF(method);
    Py_XDECREF(reinterpret_cast<PyObject*>(type));
    Py_INCREF(Py_TYPE(v));
    type = Py_TYPE(v);
    method = m;
  }
  return PyObject_CallOneArg(method, v);
}

// A pointer member's address: an int, None (0), or what the object's data_ptr() returns (a tensor's).
inline bool address_of(PyObject* v, uintptr_t& out, const char* owner, const char* name) {
  if (v == Py_None) {
    out = 0;
    return true;
  }
  PyObject* addr = v;
  if (!PyLong_Check(v)) {
    addr = call_data_ptr(v);
    if (addr == nullptr || !PyLong_Check(addr)) {
      Py_XDECREF(addr);
      return fail(PyExc_TypeError, owner, name, "an address (int), None or an object with data_ptr() (a tensor)", v);
    }
  }
  const unsigned long a = PyLong_AsUnsignedLong(addr);
  const bool bad = a == static_cast<unsigned long>(-1) && PyErr_Occurred();
  if (addr != v) Py_DECREF(addr);
  if (bad) return fail(PyExc_OverflowError, owner, name, "an address in [0, 2**64)", v);
  out = static_cast<uintptr_t>(a);
  return true;
}

template <typename T>
bool assign(T& out, PyObject* v, const char* owner, const char* name) {
  if constexpr (std::is_pointer_v<T>) {
    uintptr_t a = 0;
    if (!address_of(v, a, owner, name)) return false;
    out = reinterpret_cast<T>(a);
  } else {
    if (!PyLong_Check(v)) return fail(PyExc_TypeError, owner, name, "an int", v);
    if constexpr (std::is_signed_v<T>) {
      const long x = PyLong_AsLong(v);
      if ((x == -1 && PyErr_Occurred()) || x < std::numeric_limits<T>::min() || x > std::numeric_limits<T>::max())
        return fail(PyExc_OverflowError, owner, name, sizeof(T) == 4 ? "an int in [-2**31, 2**31)" : "an int64", v);
      out = static_cast<T>(x);
    } else {
      const unsigned long x = PyLong_AsUnsignedLong(v);
      if ((x == static_cast<unsigned long>(-1) && PyErr_Occurred()) || x > std::numeric_limits<T>::max())
        return fail(PyExc_OverflowError, owner, name,
                    sizeof(T) == 4 ? "an int in [0, 2**32)" : "an int in [0, 2**64)", v);
      out = static_cast<T>(x);
    }
  }
  return true;
}

template <typename T>
PyObject* value(const T& v) {
  if constexpr (std::is_pointer_v<T>)
    return PyLong_FromUnsignedLong(reinterpret_cast<uintptr_t>(v));
  else if constexpr (std::is_signed_v<T>)
    return PyLong_FromLong(v);
  else
    return PyLong_FromUnsignedLong(v);
}

// Sets fields[i] from every keyword; `seen` gets bit i of each member set. False: a Python error is set.
template <typename S>
bool set_by_name(S& s, const FieldTable<S>& t, PyObject* key, PyObject* v, uint64_t& seen, size_t& hint) {
  const size_t n = t.fields.size();
  // Keywords mostly come in table order (the next member), and as the interned names.
  size_t i = hint < n && t.py_names[hint] == key ? hint : n;
  for (size_t j = 0; j < n && i == n; ++j)
    if (t.py_names[j] == key) i = j;
  for (size_t j = 0; j < n && i == n; ++j)  // a name that is not the interned string
    if (PyUnicode_Compare(t.py_names[j], key) == 0) i = j;
  if (i == n) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s has no member %R (see %s.fields)", t.name, key, t.name);
    return false;
  }
  if (!t.fields[i].set(s, v, t.name, t.fields[i].name)) return false;
  seen |= uint64_t(1) << i;
  hint = i + 1;
  return true;
}

// S.set(**members): METH_FASTCALL | METH_KEYWORDS, without pybind11's per-call argument handling.
template <typename S>
PyObject* set_members(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) noexcept {
  const FieldTable<S>& t = fields_of<S>();
  if (nargs != 0) {
    PyErr_Format(PyExc_TypeError, "%s.set takes the members by name only", t.name);
    return nullptr;
  }
  S* s = nullptr;
  try {
    s = &pybind11::cast<S&>(pybind11::handle(self));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
    return nullptr;
  }
  uint64_t seen = 0;
  size_t hint = 0;
  const Py_ssize_t nkw = kwnames == nullptr ? 0 : PyTuple_GET_SIZE(kwnames);
  for (Py_ssize_t k = 0; k < nkw; ++k)
    if (!set_by_name(*s, t, PyTuple_GET_ITEM(kwnames, k), args[k], seen, hint)) return nullptr;
  if ((seen & t.pointer_mask) != t.pointer_mask) {
    std::string missing;
    for (size_t i = 0; i < t.fields.size(); ++i)
      if (((t.pointer_mask & ~seen) >> i) & 1u) missing += std::string(missing.empty() ? "" : ", ") + t.fields[i].name;
    PyErr_Format(PyExc_TypeError, "%s.set: every pointer member must be given (0 for none); missing %s", t.name,
                 missing.c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

}  // namespace fields_detail

template <auto M>
Field<typename fields_detail::MemberOf<decltype(M)>::Class> field(const char* name) {
  using S = typename fields_detail::MemberOf<decltype(M)>::Class;
  using T = typename fields_detail::MemberOf<decltype(M)>::Type;
  static_assert(std::is_integral_v<T> || std::is_pointer_v<T>, "parameter block members are integers or pointers");
  return {name, std::is_pointer_v<T>,
          [](S& s, PyObject* v, const char* owner, const char* n) { return fields_detail::assign(s.*M, v, owner, n); },
          [](const S& s) { return fields_detail::value(s.*M); }};
}
#define EP_FIELD(S, member) ::elastic_ep::bindings::field<&S::member>(#member)

template <typename S>
pybind11::class_<S> bind_fields(pybind11::module_& m, const char* doc) {
  namespace py = pybind11;
  const FieldTable<S>& t = fields_of<S>();
  if (t.fields.size() > 64) throw std::logic_error("bind_fields: at most 64 members");
  py::class_<S> cls(m, t.name, doc);
  py::list names, pointers;
  t.py_names.clear();
  for (size_t i = 0; i < t.fields.size(); ++i) {
    const Field<S>& f = t.fields[i];
    t.py_names.push_back(PyUnicode_InternFromString(f.name));  // kept for the module's life
    if (f.pointer) {
      t.pointer_mask |= uint64_t(1) << i;
      pointers.append(f.name);
    }
    names.append(f.name);
    cls.def_property(
        f.name,
        [f](const S& s) {
          PyObject* v = f.get(s);
          if (v == nullptr) throw py::error_already_set();
          return py::reinterpret_steal<py::object>(v);
        },
        [f, owner = t.name](S& s, py::handle v) {
          if (!f.set(s, v.ptr(), owner, f.name)) throw py::error_already_set();
        });
  }
  cls.def(py::init([](const py::kwargs& kw) {
            const FieldTable<S>& table = fields_of<S>();
            S s{};
            uint64_t seen = 0;
            size_t hint = 0;
            for (auto item : kw)
              if (!fields_detail::set_by_name(s, table, item.first.ptr(), item.second.ptr(), seen, hint))
                throw py::error_already_set();
            return s;
          }),
          "Every member by name; members not given are zero.");
  cls.attr("fields") = py::tuple(names);
  cls.attr("pointer_fields") = py::tuple(pointers);
  static PyMethodDef set_def = {
      "set", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&fields_detail::set_members<S>)),
      METH_FASTCALL | METH_KEYWORDS,
      "set(**members): sets the named members; every pointer member must be given (0 for none)."};
  PyObject* set = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &set_def);
  if (set == nullptr) throw py::error_already_set();
  cls.attr("set") = py::reinterpret_steal<py::object>(set);
  return cls;
}

}  // namespace elastic_ep::bindings
