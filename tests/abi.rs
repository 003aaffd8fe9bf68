//! The ABI of our header and library equals the reference's (tests/abi/stable-diffusion-abi.json):
//! (a) a C program generated from the manifest checks every struct size / alignment / field
//! offset and type, every enum constant and every callback type against OUR header;
//! (b) every manifest function and variable is exported by the built .so and .a, and our
//! prototypes match the manifest signatures exactly (assignment to pointers of the manifest's
//! types under -Werror).

mod common;

use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("abi").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn include_dir() -> PathBuf {
    common::root().join("include")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("could not run {cmd:?}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn compile_c(src: &Path, out: &Path, extra: &[&str]) {
    run(Command::new("gcc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-Wno-unused-variable", "-I"])
        .arg(include_dir())
        .arg(src)
        .args(extra)
        .arg("-o")
        .arg(out));
}

/// `ret (*name)(params)` for a manifest function.
fn pointer_decl(f: &Value, var: &str) -> String {
    let params: Vec<&str> = f["params"].as_array().unwrap().iter().map(|p| p["type"].as_str().unwrap()).collect();
    let params = if params.is_empty() { "void".to_string() } else { params.join(", ") };
    format!("{} (*{var})({params})", f["return"].as_str().unwrap())
}

#[test]
fn layout_matches_the_manifest() {
    let m = common::manifest();
    let mut c = String::from(
        "#include \"stable-diffusion.h\"\n#include <stdio.h>\n#include <stddef.h>\n\n\
         static int failures = 0;\n\
         #define CHECK(cond, ...) do { if (!(cond)) { printf(__VA_ARGS__); printf(\"\\n\"); failures++; } } while (0)\n\
         #define SAME_TYPE(a, b) __builtin_types_compatible_p(a, b)\n\n\
         int main(void) {\n",
    );
    let mut checks = 0;
    for (name, s) in m["structs"].as_object().unwrap() {
        let size = s["size"].as_u64().unwrap();
        let align = s["align"].as_u64().unwrap();
        writeln!(c, "  CHECK(sizeof({name}) == {size}, \"sizeof({name}) = %zu, want {size}\", sizeof({name}));").unwrap();
        writeln!(c, "  CHECK(_Alignof({name}) == {align}, \"_Alignof({name}) = %zu, want {align}\", _Alignof({name}));").unwrap();
        checks += 2;
        for f in s["fields"].as_array().unwrap() {
            let (fname, ty) = (f["name"].as_str().unwrap(), f["type"].as_str().unwrap());
            let (off, fsize) = (f["offset"].as_u64().unwrap(), f["size"].as_u64().unwrap());
            writeln!(
                c,
                "  CHECK(offsetof({name}, {fname}) == {off}, \"offsetof({name}, {fname}) = %zu, want {off}\", offsetof({name}, {fname}));"
            )
            .unwrap();
            writeln!(c, "  CHECK(sizeof((({name} *)0)->{fname}) == {fsize}, \"sizeof({name}.{fname}) differs\");").unwrap();
            writeln!(
                c,
                "  CHECK(SAME_TYPE(__typeof__((({name} *)0)->{fname}), {ty}), \"type of {name}.{fname} is not {ty}\");"
            )
            .unwrap();
            checks += 3;
        }
    }
    for (name, e) in m["enums"].as_object().unwrap() {
        let unsigned = e["underlying"] != "int";
        writeln!(c, "  CHECK(sizeof(enum {name}) == 4, \"sizeof(enum {name}) != 4\");").unwrap();
        writeln!(
            c,
            "  CHECK(((enum {name})-1 > 0) == {}, \"signedness of enum {name} differs\");",
            unsigned as i32
        )
        .unwrap();
        checks += 2;
        for k in e["constants"].as_array().unwrap() {
            let (kname, v) = (k["name"].as_str().unwrap(), k["value"].as_i64().unwrap());
            writeln!(c, "  CHECK((long long){kname} == {v}LL, \"{kname} = %lld, want {v}\", (long long){kname});").unwrap();
            checks += 1;
        }
    }
    for (name, cb) in m["callbacks"].as_object().unwrap() {
        let params: Vec<&str> = cb["params"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        let ty = format!("{} (*)({})", cb["return"].as_str().unwrap(), params.join(", "));
        writeln!(c, "  CHECK(sizeof({name}) == sizeof(void *), \"sizeof({name})\");").unwrap();
        writeln!(c, "  CHECK(SAME_TYPE({name}, {ty}), \"{name} is not {ty}\");").unwrap();
        checks += 2;
    }
    for name in m["opaque"].as_array().unwrap() {
        writeln!(c, "  {{ {0} *p = NULL; (void)p; }}", name.as_str().unwrap()).unwrap();
    }
    c.push_str("  struct ggml_tensor *t = NULL; (void)t;\n");
    c.push_str("  if (failures == 0) printf(\"layout ok\\n\");\n  return failures != 0;\n}\n");

    let dir = scratch("layout");
    let src = dir.join("layout.c");
    std::fs::write(&src, &c).unwrap();
    let exe = dir.join("layout");
    compile_c(&src, &exe, &[]);
    let out = run(&mut Command::new(&exe));
    assert!(out.contains("layout ok"), "{out}");
    assert!(checks > 500, "only {checks} checks generated");
}

#[test]
fn prototypes_match_the_manifest() {
    let m = common::manifest();
    let mut c = String::from("#include \"stable-diffusion.h\"\n\nvoid check_prototypes(void);\nvoid check_prototypes(void) {\n");
    for (name, f) in m["functions"].as_object().unwrap() {
        writeln!(c, "  {} = {name}; (void)p_{name};", pointer_decl(f, &format!("p_{name}"))).unwrap();
    }
    for (name, v) in m["variables"].as_object().unwrap() {
        assert_eq!(v["type"], "const char *[]", "{name}");
        writeln!(c, "  const char **v_{name} = {name}; (void)v_{name};").unwrap();
        writeln!(c, "  const char *(*a_{name})[] = &{name}; (void)a_{name};").unwrap();
    }
    c.push_str("}\n");
    let dir = scratch("prototypes");
    let src = dir.join("prototypes.c");
    std::fs::write(&src, &c).unwrap();
    compile_c(&src, &dir.join("prototypes.o"), &["-c", "-Wincompatible-pointer-types", "-pedantic"]);

    // Every prototype carries the visibility macro, like the reference's.
    let header = std::fs::read_to_string(include_dir().join("stable-diffusion.h")).unwrap();
    for name in m["functions"].as_object().unwrap().keys() {
        let line = header
            .lines()
            .find(|l| l.contains(&format!(" {name}(")) || l.contains(&format!("*{name}(")))
            .unwrap_or_else(|| panic!("{name} is not declared in the header"));
        assert!(line.starts_with("SD_API "), "{name}: {line}");
    }
}

#[test]
fn header_compiles_as_cpp() {
    let dir = scratch("cpp");
    let src = dir.join("use.cpp");
    std::fs::write(
        &src,
        "#include \"stable-diffusion.h\"\n#include <cstdio>\n\
         int main() { sd_img_gen_params_t p; sd_img_gen_params_init(&p); enum sample_method_t m = EULER_A_SAMPLE_METHOD;\n\
         sample_method_t m2 = m; bool ok = sd_ctx_supports_image_generation(nullptr); std::printf(\"%d %d %s\\n\", (int)m2, (int)ok, sample_method_to_str[0]); return 0; }\n",
    )
    .unwrap();
    run(Command::new("g++")
        .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", "-I"])
        .arg(include_dir())
        .arg(&src));
}

/// Defined symbols of a library (`nm` output: "address type name").
fn defined_symbols(args: &[&str], lib: &Path) -> Vec<(String, String)> {
    let out = run(Command::new("nm").args(args).arg("--defined-only").arg(lib));
    out.lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace().rev();
            let name = parts.next()?;
            let kind = parts.next()?;
            Some((kind.to_string(), name.to_string()))
        })
        .collect()
}

#[test]
fn library_exports_every_symbol() {
    let m = common::manifest();
    let dir = common::artifact_dir();
    let so = dir.join("libstable_diffusion.so");
    let a = dir.join("libstable_diffusion.a");
    for lib in [&so, &a] {
        assert!(
            lib.exists(),
            "{} is missing: build the library first (`cargo build --lib`; cargo test builds it too)",
            lib.display()
        );
    }
    let dynamic = defined_symbols(&["-D"], &so);
    let archive = defined_symbols(&[], &a);
    let mut missing = Vec::new();
    let funcs = m["functions"].as_object().unwrap().keys().map(|n| (n, "T"));
    let vars = m["variables"].as_object().unwrap().keys().map(|n| (n, "D"));
    for (name, kind) in funcs.chain(vars) {
        for (lib, syms) in [("so", &dynamic), ("a", &archive)] {
            let found = syms.iter().find(|(_, n)| n == name);
            match found {
                Some((k, _)) if k.eq_ignore_ascii_case(kind) || (kind == "D" && matches!(k.as_str(), "D" | "d" | "B" | "R")) => {}
                Some((k, _)) => missing.push(format!("{name} in .{lib} has symbol type {k}, want {kind}")),
                None => missing.push(format!("{name} is not exported by the .{lib}")),
            }
        }
    }
    assert_eq!(m["functions"].as_object().unwrap().len(), 62);
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

#[test]
fn c_program_links_and_runs_against_the_shared_library() {
    let dir = scratch("link");
    let src = dir.join("use.c");
    std::fs::write(
        &src,
        r#"#include "stable-diffusion.h"
#include <stdio.h>
#include <stdlib.h>
static int errors = 0;
static void on_log(enum sd_log_level_t level, const char* text, void* data) {
    if (level == SD_LOG_ERROR) ++*(int*)data;
    (void)text;
}
int main(void) {
    sd_set_log_callback(on_log, &errors);
    sd_img_gen_params_t p;
    sd_img_gen_params_init(&p);
    char* s = sd_img_gen_params_to_str(&p);
    if (!s || p.width != 512 || p.sample_params.sample_method != SAMPLE_METHOD_COUNT) return 1;
    free(s);
    if (str_to_sample_method(sample_method_to_str[EULER_A_SAMPLE_METHOD]) != EULER_A_SAMPLE_METHOD) return 2;
    sd_ctx_params_t c;
    sd_ctx_params_init(&c);
    if (new_sd_ctx(&c) != NULL || errors != 1) return 3;
    size_t n = sd_list_devices(NULL, 0);
    if (n == 0) return 4;
    printf("ok %s %s\n", sd_version(), sd_scheduler_name(KARRAS_SCHEDULER));
    return 0;
}
"#,
    )
    .unwrap();
    // The library's soname is the shipped name, libstable-diffusion.so.<major>.
    let built = common::artifact_dir().join("libstable_diffusion.so");
    let shipped = dir.join("libstable-diffusion.so.0");
    let _ = std::fs::remove_file(&shipped);
    std::os::unix::fs::symlink(&built, &shipped).unwrap();
    let exe = dir.join("use");
    compile_c(&src, &exe, &[built.to_str().unwrap(), &format!("-Wl,-rpath,{}", dir.display())]);
    let out = run(&mut Command::new(&exe));
    assert!(out.contains("ok 0.1.0 karras"), "{out}");
}
