//! Communicators for the tensor-parallel, context-parallel and control groups of a mesh.
