// tokenizers-cpp's SentencePiece and RWKV-World factories, which this client build does not provide.
//
// tokenizers-cpp implements them in src/sentencepiece_tokenizer.cc and src/rwkv_world_tokenizer.cc over its
// `sentencepiece` and `msgpack` git submodules; a `git archive` holds no submodule contents, so the vendor
// archive has neither library and those two files cannot be compiled here. Our bundles always carry a
// tokenizer.json (MLC's Tokenizer::FromPath prefers it over tokenizer.model), which goes through
// tokenizers-cpp's huggingface_tokenizer.cc and our Python-backed C API (tokenizers_c_python.cc).
// Written for this project; see docs/mlc-engine.md.

#include <tokenizers_cpp.h>
#include <tvm/ffi/error.h>

#include <memory>
#include <string>

namespace tokenizers {

std::unique_ptr<Tokenizer> Tokenizer::FromBlobSentencePiece(const std::string& model_blob) {
  TVM_FFI_THROW(RuntimeError) << "SentencePiece tokenizer.model not supported by this client build; "
                                 "use a tokenizer.json";
}

std::unique_ptr<Tokenizer> Tokenizer::FromBlobRWKVWorld(const std::string& model_blob) {
  TVM_FFI_THROW(RuntimeError) << "RWKV-World tokenizer_model not supported by this client build; "
                                 "use a tokenizer.json";
}

}  // namespace tokenizers
