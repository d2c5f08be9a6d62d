// An emulated NVRTC (libnvrtc) for the emulated driver (driver.cpp): "compiling" a kernel file
// builds it for the host as C++ with host_shim.h (MANTISSA_EMU_SHIM names it), adds
// trampolines per kernel that copy a launch's arguments by the kernel's own parameter types
// and call the kernel with them, and hands back the library's path as the
// "cubin". A source that does not build gives NVRTC_ERROR_COMPILATION with the compiler's
// output as the log.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>

typedef int nvrtcResult;
enum { NVRTC_SUCCESS = 0, NVRTC_ERROR_INVALID_INPUT = 3, NVRTC_ERROR_COMPILATION = 6 };

struct Program {
    std::string src, name, log, cubin;
};

#define API extern "C" __attribute__((visibility("default")))

API nvrtcResult nvrtcVersion(int* major, int* minor) {
#ifdef EMU_CUDA12
    *major = 12;
#else
    *major = 13;
#endif
    *minor = 0;
    return NVRTC_SUCCESS;
}
API const char* nvrtcGetErrorString(nvrtcResult r) {
    return r == NVRTC_ERROR_COMPILATION ? "NVRTC_ERROR_COMPILATION (emulated)" : "emulated NVRTC error";
}
API nvrtcResult nvrtcCreateProgram(Program** p, const char* src, const char* name, int, const char* const*,
                                   const char* const*) {
    *p = new Program{src, name ? name : "kernel.cu", "", ""};
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcDestroyProgram(Program** p) {
    delete *p;
    *p = nullptr;
    return NVRTC_SUCCESS;
}

// Runs `cmd`, appending its output to `log`; true when it exits 0.
static bool run(const std::string& cmd, std::string& log) {
    FILE* f = popen((cmd + " 2>&1").c_str(), "r");
    if (!f) return false;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) log.append(buf, n);
    return pclose(f) == 0;
}

static bool write(const std::string& path, const std::string& text) {
    FILE* f = fopen(path.c_str(), "w");
    if (!f) return false;
    fwrite(text.data(), 1, text.size(), f);
    return fclose(f) == 0;
}

// Per kernel: NAME__bind copies a launch's arguments (read through the launch's pointers by
// the kernel's own parameter types), NAME__run calls the kernel with a copy, NAME__release
// frees it, NAME__param_bytes is the size of its parameter buffer.
static const char* TRAMPOLINE = R"(
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
template <typename... A> struct MantissaArgs {
    std::tuple<std::remove_cvref_t<A>...> values;
};
template <typename... A, std::size_t... I>
static void* mantissa_bind(void (*)(A...), void** p, std::index_sequence<I...>) {
    return new MantissaArgs<A...>{{*static_cast<std::remove_cvref_t<A>*>(p[I])...}};
}
template <typename... A> static void* mantissa_bind(void (*f)(A...), void** p) {
    return mantissa_bind(f, p, std::index_sequence_for<A...>{});
}
template <typename... A> static void mantissa_run(void (*f)(A...), void* args) {
    std::apply(f, static_cast<MantissaArgs<A...>*>(args)->values);
}
template <typename... A> static void mantissa_release(void (*)(A...), void* args) {
    delete static_cast<MantissaArgs<A...>*>(args);
}
// The bytes of the kernel's parameter buffer: each parameter at its own alignment, in order,
// as the CUDA ABI lays them out.
template <typename... A> static constexpr std::size_t mantissa_param_bytes(void (*)(A...)) {
    std::size_t at = 0;
    ((at = (at + alignof(std::remove_cvref_t<A>) - 1) / alignof(std::remove_cvref_t<A>) *
                   alignof(std::remove_cvref_t<A>) +
               sizeof(std::remove_cvref_t<A>)),
     ...);
    return at;
}
)";


static bool ident(char c) { return isalnum((unsigned char)c) || c == '_'; }

// The name of the function whose body opens at t[i] ('{' at file scope), or "" when the
// brace opens something else (a struct, an initialiser).
static std::string function_name(const std::string& t, size_t i) {
    size_t j = i;
    auto back_space = [&] { while (j > 0 && isspace((unsigned char)t[j - 1])) j--; };
    back_space();
    while (j > 0 && ident(t[j - 1])) { // qualifiers after the parameter list (const, noexcept)
        size_t e = j;
        while (j > 0 && ident(t[j - 1])) j--;
        std::string word = t.substr(j, e - j);
        if (word != "const" && word != "noexcept") return "";
        back_space();
    }
    if (j == 0 || t[j - 1] != ')') return "";
    for (int depth = 0; j > 0;) { // back over the parameter list
        char c = t[--j];
        depth += c == ')' ? 1 : c == '(' ? -1 : 0;
        if (depth == 0) break;
    }
    back_space();
    if (j > 0 && t[j - 1] == '>') { // a specialisation: from_f32<f16>(...)
        for (int depth = 0; j > 0;) {
            char c = t[--j];
            depth += c == '>' ? 1 : c == '<' ? -1 : 0;
            if (depth == 0) break;
        }
    }
    size_t e = j;
    while (j > 0 && ident(t[j - 1])) j--;
    return t.substr(j, e - j);
}

// Whether `word` occurs in `text` as a whole identifier.
static bool mentions(const std::string& text, const std::string& word) {
    for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
        size_t e = at + word.size();
        if ((at == 0 || !ident(text[at - 1])) && (e >= text.size() || !ident(text[e]))) return true;
    }
    return false;
}

// The functions of preprocessed text `t` that reach a block barrier, a warp shuffle or a
// compare-and-swap (directly or through the functions they call, judged by name): their
// blocks' threads run as fibers that take turns (host_shim.h). The others run one
// thread after another.
static std::set<std::string> cooperative(const std::string& t) {
    std::map<std::string, std::string> bodies;
    int depth = 0;
    size_t start = 0;
    std::string name;
    for (size_t i = 0; i < t.size(); i++) {
        char c = t[i];
        if (c == '"' || c == '\'') { // skip a literal
            for (i++; i < t.size() && t[i] != c; i++) i += t[i] == '\\';
            continue;
        }
        if (c == '{') {
            if (depth++ == 0) start = i, name = function_name(t, i);
        } else if (c == '}' && --depth == 0 && !name.empty()) {
            bodies[name] += t.substr(start, i - start + 1);
        }
    }
    std::set<std::string> coop = {"__syncthreads", "__shfl_xor_sync", "atomicCAS"};
    for (bool grew = true; grew;) {
        grew = false;
        for (auto& [f, body] : bodies) {
            if (coop.count(f)) continue;
            for (auto& g : coop) {
                if (mentions(body, g)) {
                    coop.insert(f);
                    grew = true;
                    break;
                }
            }
        }
    }
    return coop;
}

API nvrtcResult nvrtcCompileProgram(Program* p, int nopts, const char* const* opts) {
    const char* shim = getenv("MANTISSA_EMU_SHIM");
    if (!shim) {
        p->log = "MANTISSA_EMU_SHIM (the path of host_shim.h) is not set";
        return NVRTC_ERROR_COMPILATION;
    }
    const char* cxx = getenv("CXX") ? getenv("CXX") : "c++";
    // Built libraries stay while the process may load them: under MANTISSA_EMU_TMP, which
    // run.sh removes at the end (else the system's temporary folder).
    const char* tmp = getenv("MANTISSA_EMU_TMP") ? getenv("MANTISSA_EMU_TMP") : "/tmp";
    std::string dir = std::string(tmp) + "/mantissa-emu-XXXXXX";
    if (!mkdtemp(dir.data())) return NVRTC_ERROR_INVALID_INPUT;
    std::string base = std::string(dir) + "/" + p->name;
    std::string text = "#include \"" + std::string(shim) + "\"\n" + p->src +
                       "\n#define MANTISSA_HOST_TAIL\n#include \"" + shim + "\"\n";
    if (!write(base + ".cpp", text)) return NVRTC_ERROR_INVALID_INPUT;
    // The kernels' names, from the preprocessed text with __global__ left as a marker.
    std::string pre;
    std::string flags = " -std=c++20 -w -x c++ ";
    // Macro definitions pass through to the host compiler (a kernel file's part:
    // -DMANTISSA_PART=k); NVRTC's other options have no host meaning.
    for (int i = 0; i < nopts; i++) {
        std::string o = opts[i];
        bool plain = o.find_first_of("'\"\\ $`;|&<>()") == std::string::npos;
        if (o.rfind("-D", 0) == 0 && plain) flags += o + " ";
    }
    if (!run(std::string(cxx) + flags + "-E -P -D__global__=MANTISSA_KERNEL " + base + ".cpp", pre)) {
        p->log = pre;
        return NVRTC_ERROR_COMPILATION;
    }
    std::string tramp = TRAMPOLINE;
    std::set<std::string> coop = cooperative(pre);
    const std::string mark = "MANTISSA_KERNEL void ";
    for (size_t at = pre.find(mark); at != std::string::npos; at = pre.find(mark, at + 1)) {
        size_t s = at + mark.size(), e = s;
        while (e < pre.size() && ident(pre[e])) e++;
        std::string k = pre.substr(s, e - s);
        tramp += "extern \"C\" void* " + k + "__bind(void** p) { return mantissa_bind(&" + k + ", p); }\n";
        tramp += "extern \"C\" void " + k + "__run(void* a) { mantissa_run(&" + k + ", a); }\n";
        tramp += "extern \"C\" void " + k + "__release(void* a) { mantissa_release(&" + k + ", a); }\n";
        tramp += "extern \"C\" int " + k + "__cooperative = " + (coop.count(k) ? "1" : "0") + ";\n";
        tramp += "extern \"C\" std::size_t " + k + "__param_bytes = mantissa_param_bytes(&" + k + ");\n";
    }
    if (!write(base + ".cpp", text + tramp)) return NVRTC_ERROR_INVALID_INPUT;
    std::string so = base + ".so";
    // MANTISSA_EMU_CXXFLAGS: extra flags for the kernels' build (run.sh's sanitizer runs).
    const char* extra = getenv("MANTISSA_EMU_CXXFLAGS") ? getenv("MANTISSA_EMU_CXXFLAGS") : "";
    if (!run(std::string(cxx) + flags + extra + " -O1 -shared -fPIC " + base + ".cpp -o " + so, p->log)) {
        return NVRTC_ERROR_COMPILATION;
    }
    p->cubin = so;
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetProgramLogSize(Program* p, size_t* n) {
    *n = p->log.size() + 1;
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetProgramLog(Program* p, char* out) {
    memcpy(out, p->log.c_str(), p->log.size() + 1);
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetCUBINSize(Program* p, size_t* n) {
    *n = p->cubin.size() + 1;
    return NVRTC_SUCCESS;
}
API nvrtcResult nvrtcGetCUBIN(Program* p, char* out) {
    memcpy(out, p->cubin.c_str(), p->cubin.size() + 1);
    return NVRTC_SUCCESS;
}
